"""Property and fuzz tests for static_dist.artifact: every malformed, tampered, mis-keyed, wrong-device or
oversized artifact is rejected with its typed ArtifactError subclass; none is accepted; nothing else escapes."""
import hashlib
import io
from dataclasses import asdict, replace

import pytest
import torch
import cbor2
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from static_dist.artifact import (  # noqa: E402
    MAGIC, ArtifactError, ArtifactFormatError, BadMagicError, DeviceMismatchError, DigestMismatchError, Fingerprint,
    PayloadTooLargeError, PlatformPolicy, SignatureError, UnsupportedVersionError, UntrustedKeyError, _signed_message,
    device_fingerprint, key_id, load_artifact, load_trusted_keys, sign_payload, verify_artifact)

FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz(n: int):
    """Hypothesis settings with `n` examples (no deadline, no example database written to the repo)."""
    return settings(FUZZ, max_examples=n)

# --- one valid artifact, built once -------------------------------------------------------------------------------
KEY = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"static_dist fuzz trusted key").digest())
OTHER = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"static_dist fuzz other key").digest())
TRUST = load_trusted_keys(KEY)
HERE = device_fingerprint()


def _payload() -> bytes:
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.relu(self.lin(x))

    buf = io.BytesIO()
    torch.export.save(torch.export.export(M(), (torch.randn(2, 4),)), buf)
    return buf.getvalue()


PAYLOAD = _payload()
VALID = sign_payload(PAYLOAD, signing_key=KEY)
TOP = cbor2.loads(VALID)


def _field_ranges(top) -> dict:
    """Byte range of each item's *content* inside the encoded array (the array header is one byte: 0x86)."""
    assert VALID[0] == 0x86
    out, pos = {}, 1
    for name, item in zip(["magic", "version", "header", "payload", "key_id", "signature"], top):
        enc = cbor2.dumps(item)
        content = len(item if isinstance(item, bytes) else item.encode()) if isinstance(item, (bytes, str)) else len(enc)
        out[name] = (pos + len(enc) - content, pos + len(enc))
        pos += len(enc)
    assert pos == len(VALID)
    return out


FIELDS = _field_ranges(TOP)


def rejected(data, *allowed, **kw):
    """Assert verify_artifact rejects `data` with one of `allowed` (default: any ArtifactError); anything else fails."""
    allowed = allowed or (ArtifactError,)
    kw.setdefault("trusted_keys", TRUST)
    try:
        verify_artifact(data, **kw)
    except allowed as e:
        return e
    except ArtifactError as e:  # typed, but not the expected type
        pytest.fail(f"expected {[c.__name__ for c in allowed]}, got {type(e).__name__}: {e}")
    pytest.fail("a corrupted artifact was accepted")


def flip(data: bytes, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


# --- sanity: the valid artifact is accepted and loads ------------------------------------------------------------
def test_valid_artifact_loads():
    v = verify_artifact(VALID, trusted_keys=TRUST)
    assert v.payload == PAYLOAD and v.key_id == key_id(KEY) and v.fingerprint == HERE
    ep = load_artifact(VALID, trusted_keys=TRUST)
    x = torch.randn(2, 4)
    ref = torch.export.load(io.BytesIO(PAYLOAD)).module()(x)
    assert torch.equal(ep.module()(x), ref)


def test_field_map_covers_file():
    assert FIELDS["magic"] == (2, 2 + len(MAGIC))
    assert VALID[slice(*FIELDS["payload"])] == PAYLOAD


# --- truncation ---------------------------------------------------------------------------------------------------
@fuzz(600)
@given(st.integers(0, len(VALID) - 1))
def test_truncation(n):
    rejected(VALID[:n], ArtifactFormatError)


def test_truncation_every_field_boundary():
    for a, b in FIELDS.values():
        for n in {a - 1, a, (a + b) // 2, b - 1}:
            rejected(VALID[:n], ArtifactFormatError)


# --- bit flips ----------------------------------------------------------------------------------------------------
@fuzz(1500)
@given(st.integers(0, 8 * len(VALID) - 1))
def test_bit_flip_anywhere(bit):
    rejected(flip(VALID, bit))


# Which errors a flip inside each field's content may give (structure-preserving flips are exact).
EXPECTED = {
    "magic": (BadMagicError,),
    "version": (ArtifactFormatError, UnsupportedVersionError),
    "header": (ArtifactFormatError, DeviceMismatchError, SignatureError, UnsupportedVersionError, PayloadTooLargeError,
               UntrustedKeyError),
    "payload": (DigestMismatchError,),
    "key_id": (ArtifactFormatError, SignatureError),
    "signature": (SignatureError,),
}


@fuzz(1500)
@given(st.sampled_from(sorted(FIELDS)), st.data())
def test_bit_flip_in_every_field(field, data):
    a, b = FIELDS[field]
    bit = data.draw(st.integers(8 * a, 8 * b - 1), label="bit")
    rejected(flip(VALID, bit), *EXPECTED[field])


@fuzz(300)
@given(st.sampled_from(sorted(FIELDS)), st.data())
def test_byte_overwrite_in_every_field(field, data):
    a, b = FIELDS[field]
    i = data.draw(st.integers(a, b - 1))
    v = data.draw(st.integers(0, 255).filter(lambda v: v != VALID[i]))
    rejected(VALID[:i] + bytes([v]) + VALID[i + 1:], *EXPECTED[field])


# --- random input -------------------------------------------------------------------------------------------------
@fuzz(800)
@given(st.binary(max_size=4096))
def test_random_bytes(data):
    rejected(data)


@fuzz(500)
@given(st.binary(max_size=512))
def test_random_bytes_after_valid_prefix(tail):
    # deeper than pure noise: a 6-item array with the right magic and version, then garbage
    rejected(b"\x86" + cbor2.dumps(MAGIC) + cbor2.dumps(1) + tail)


CBOR_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats() | st.binary(max_size=64) | st.text(max_size=32),
    lambda c: st.lists(c, max_size=8) | st.dictionaries(st.text(max_size=8) | st.integers(), c, max_size=8),
    max_leaves=8)


@fuzz(300)
@given(CBOR_VALUES)
def test_random_cbor_documents(obj):
    rejected(cbor2.dumps(obj))


@fuzz(300)
@given(st.lists(CBOR_VALUES, min_size=6, max_size=6), st.sets(st.integers(0, 5), min_size=1))
def test_six_items_with_random_fields(rand, which):
    items = [rand[i] if i in which else TOP[i] for i in range(6)]
    rejected(cbor2.dumps(items))


# --- signed by a trusted key, but with a header that lies or is malformed ----------------------------------------
def _signed(header: dict, payload: bytes = PAYLOAD, key=KEY, outer_kid=None) -> bytes:
    raw = cbor2.dumps(header, canonical=True)
    return cbor2.dumps([MAGIC, 1, raw, payload, outer_kid or key_id(key), key.sign(_signed_message(1, raw))])


HEADER = cbor2.loads(TOP[2])


@fuzz(400)
@given(st.sampled_from(sorted(HEADER)), CBOR_VALUES)
def test_signed_header_with_a_wrong_field(field, value):
    if value == HEADER[field] and type(value) is type(HEADER[field]):
        return
    art = _signed(dict(HEADER, **{field: value}))
    # 'created' and 'meta' are free-form: any well-typed value signed by a trusted key is legitimate
    if (field == "created" and type(value) is str) or (
            field == "meta" and type(value) is dict and all(type(k) is str and type(v) is str for k, v in value.items())):
        assert verify_artifact(art, trusted_keys=TRUST).header[field] == value
    else:
        rejected(art)


@fuzz(200)
@given(st.integers(0, 2 ** 40))
def test_signed_header_with_wrong_payload_size(size):
    if size == len(PAYLOAD):
        return
    rejected(_signed(dict(HEADER, payload_size=size)), DigestMismatchError, PayloadTooLargeError)


def test_signed_header_with_extra_or_missing_field():
    rejected(_signed(dict(HEADER, extra="x")), ArtifactFormatError)
    h = dict(HEADER)
    del h["created"]
    rejected(_signed(h), ArtifactFormatError)


# --- wrong keys ---------------------------------------------------------------------------------------------------
@fuzz(150)
@given(st.binary(min_size=32, max_size=32))
def test_signed_by_an_untrusted_key(seed):
    attacker = Ed25519PrivateKey.from_private_bytes(seed)
    if key_id(attacker) == key_id(KEY):
        return
    art = sign_payload(PAYLOAD, signing_key=attacker)
    rejected(art, UntrustedKeyError)
    # claiming the trusted key's id (in the signed header and outside) does not help: the signature fails
    rejected(_signed(dict(HEADER, key_id=key_id(KEY)), key=attacker, outer_kid=key_id(KEY)), SignatureError)
    # and trusting only the attacker's key rejects the genuine artifact
    rejected(VALID, UntrustedKeyError, trusted_keys=load_trusted_keys(attacker))


def test_no_trusted_keys():
    rejected(VALID, UntrustedKeyError, trusted_keys={})


def test_signature_of_other_artifact():
    other = cbor2.loads(sign_payload(PAYLOAD + b"x", signing_key=KEY))
    rejected(cbor2.dumps([*TOP[:5], other[5]]), SignatureError)  # a genuine signature, for another header


# --- wrong device -------------------------------------------------------------------------------------------------
@fuzz(300)
@given(st.sampled_from(list(asdict(HERE))), st.text(max_size=24))
def test_wrong_device(field, value):
    if value == getattr(HERE, field):
        return
    other = replace(HERE, **{field: value})
    e = rejected(VALID, DeviceMismatchError, device=other)
    assert field in str(e)
    # and an artifact built for `other` is refused here, but accepted there
    art = sign_payload(PAYLOAD, signing_key=KEY, device=other, policy={"*": PlatformPolicy(frozenset({1}), 1 << 30)})
    rejected(art, DeviceMismatchError)
    assert verify_artifact(art, trusted_keys=TRUST, device=other, policy={"*": PlatformPolicy(frozenset({1}), 1 << 30)}).payload == PAYLOAD


# --- oversize -----------------------------------------------------------------------------------------------------
@fuzz(300)
@given(st.integers(0, len(PAYLOAD) - 1))
def test_payload_over_policy(limit):
    pol = {"*": PlatformPolicy(frozenset({1}), limit)}
    here_any = Fingerprint(HERE.device_type, HERE.device_model, "Plan9", "mips", HERE.torch)  # uses the '*' entry
    art = sign_payload(PAYLOAD, signing_key=KEY, device=here_any)
    rejected(art, PayloadTooLargeError, device=here_any, policy=pol)
    with pytest.raises(PayloadTooLargeError):
        sign_payload(PAYLOAD, signing_key=KEY, device=here_any, policy=pol)


def test_huge_file_refused_before_parsing(tmp_path):
    p = tmp_path / "big.sdxa"
    with open(p, "wb") as f:
        f.truncate(300 << 20)  # sparse: 300 MiB of zeros, over the '*' policy limit of 256 MiB + header
    here_any = Fingerprint(HERE.device_type, HERE.device_model, "Plan9", "mips", HERE.torch)
    rejected(str(p), PayloadTooLargeError, device=here_any)


def test_version_not_accepted_by_policy():
    rejected(VALID, UnsupportedVersionError, policy={"*": PlatformPolicy(frozenset({2}), 1 << 30),
                                                     (HERE.os, HERE.arch): PlatformPolicy(frozenset({2}), 1 << 30)})
