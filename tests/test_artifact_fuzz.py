"""Property and fuzz tests for static_dist.artifact: every malformed, tampered, mis-keyed, wrong-device or
oversized artifact is rejected with its typed ArtifactError subclass; none is accepted; nothing else escapes."""
import hashlib
import io
import os
import struct
import threading
from dataclasses import asdict, replace

import pytest
import torch
import cbor2
from hypothesis import HealthCheck, assume, given, settings, strategies as st  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from static_dist.artifact import (  # noqa: E402
    MAGIC,
    ArtifactError,
    ArtifactFileError,
    ArtifactUsageError,
    ArtifactFormatError,
    BadMagicError,
    DeviceMismatchError,
    DigestMismatchError,
    Fingerprint,
    PayloadTooLargeError,
    PlatformPolicy,
    SignatureError,
    UnsupportedVersionError,
    UntrustedKeyError,
    signed_message,
    device_fingerprint,
    key_id,
    load_artifact,
    load_trusted_keys,
    sign_payload,
    verify_artifact,
)

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
        content = (
            len(item if isinstance(item, bytes) else item.encode()) if isinstance(item, (bytes, str)) else len(enc)
        )
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
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.binary(max_size=64)
    | st.text(max_size=32),
    lambda c: st.lists(c, max_size=8) | st.dictionaries(st.text(max_size=8) | st.integers(), c, max_size=8),
    max_leaves=8,
)


@fuzz(300)
@given(CBOR_VALUES)
def test_random_cbor_documents(obj):
    rejected(cbor2.dumps(obj))


@fuzz(300)
@given(st.lists(CBOR_VALUES, min_size=6, max_size=6), st.sets(st.integers(0, 5), min_size=1))
def test_six_items_with_random_fields(rand, which):
    items = [rand[i] if i in which else TOP[i] for i in range(6)]
    assume(cbor2.dumps(items) != cbor2.dumps(TOP))      # a "random" field equal to the real one is no corruption
    rejected(cbor2.dumps(items))


# --- signed by a trusted key, but with a header that lies or is malformed ----------------------------------------
def _signed(header: dict, payload: bytes = PAYLOAD, key=KEY, outer_kid=None) -> bytes:
    raw = cbor2.dumps(header, canonical=True)
    return cbor2.dumps([MAGIC, 1, raw, payload, outer_kid or key_id(key), key.sign(signed_message(1, raw))])


HEADER = cbor2.loads(TOP[2])


@fuzz(400)
@given(st.sampled_from(sorted(HEADER)), CBOR_VALUES)
def test_signed_header_with_a_wrong_field(field, value):
    if value == HEADER[field] and type(value) is type(HEADER[field]):
        return
    art = _signed(dict(HEADER, **{field: value}))
    # 'created' and 'meta' are free-form: any well-typed value signed by a trusted key is legitimate
    if (field == "created" and type(value) is str) or (
        field == "meta" and type(value) is dict and all(type(k) is str and type(v) is str for k, v in value.items())
    ):
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
    assert (
        verify_artifact(
            art, trusted_keys=TRUST, device=other, policy={"*": PlatformPolicy(frozenset({1}), 1 << 30)}
        ).payload
        == PAYLOAD
    )


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


# --- canonical CBOR only: the bytes on disk are the bytes that were signed --------------------------------------
def _head(draw, mt: int, arg: int) -> bytes:
    "A CBOR head for (major type, argument), in any legal width the argument fits (the shortest, or a longer one)."
    widths = [w for w, lim in ((0, 24), (1, 1 << 8), (2, 1 << 16), (4, 1 << 32), (8, 1 << 64)) if arg < lim]
    w = draw(st.sampled_from(widths))
    if w == 0: return bytes([mt << 5 | arg])
    return bytes([mt << 5 | {1: 24, 2: 25, 4: 26, 8: 27}[w]]) + arg.to_bytes(w, "big")


def _encode(draw, obj) -> bytes:
    "`obj` (ints >= 0, bytes, str, lists, maps) CBOR-encoded with random head widths and random indefinite lengths."
    indef = draw(st.booleans())
    if isinstance(obj, int): return _head(draw, 0, obj)
    if isinstance(obj, (bytes, str)):
        mt, raw = (2, obj) if isinstance(obj, bytes) else (3, obj.encode())
        if indef and (isinstance(obj, bytes) or raw.isascii()):  # chunks split on byte (ASCII: character) boundaries
            cut = draw(st.integers(0, len(raw)))
            return (
                bytes([mt << 5 | 31]) + b"".join(_head(draw, mt, len(c)) + c for c in (raw[:cut], raw[cut:])) + b"\xff"
            )
        return _head(draw, mt, len(raw)) + raw
    if isinstance(obj, list):
        body = b"".join(_encode(draw, x) for x in obj)
        return (b"\x9f" + body + b"\xff") if indef else _head(draw, 4, len(obj)) + body
    if isinstance(obj, dict):
        body = b"".join(_encode(draw, k) + _encode(draw, v) for k, v in obj.items())
        return (b"\xbf" + body + b"\xff") if indef else _head(draw, 5, len(obj)) + body
    raise TypeError(type(obj))


@fuzz(400)
@given(st.data())
def test_any_other_encoding_of_the_artifact_is_refused(data):
    """The same six items, with random head widths and indefinite lengths: cbor2 reads them all; only the canonical form
    passes."""
    enc = _encode(data.draw, TOP)
    assert cbor2.loads(enc) == TOP
    if enc == VALID:
        assert verify_artifact(enc, trusted_keys=TRUST).payload == PAYLOAD
    else:
        e = rejected(enc, ArtifactFormatError)
        assert "not canonical CBOR" in str(e)


@fuzz(300)
@given(st.data())
def test_any_other_encoding_of_a_signed_header_is_refused(data):
    "A header re-encoded (widths, indefinite lengths, key order) and *signed by the trusted key*: still refused."
    h = dict(HEADER, fingerprint=dict(HEADER["fingerprint"]), meta={"a": "1", "bb": "2"})
    h = dict(data.draw(st.permutations(list(h.items()))))
    raw = _encode(data.draw, h)
    art = cbor2.dumps([MAGIC, 1, raw, PAYLOAD, key_id(KEY), KEY.sign(signed_message(1, raw))], canonical=True)
    if raw == cbor2.dumps(h, canonical=True):
        assert verify_artifact(art, trusted_keys=TRUST).header == h
    else:
        assert "not canonical CBOR" in str(rejected(art, ArtifactFormatError))


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_non_minimal_version_int(width):
    enc = (
        bytes([0x86])
        + cbor2.dumps(MAGIC)
        + bytes([{1: 0x18, 2: 0x19, 4: 0x1A, 8: 0x1B}[width]])
        + (1).to_bytes(width, "big")
    )
    enc += b"".join(cbor2.dumps(x) for x in TOP[2:])
    assert cbor2.loads(enc) == TOP
    assert "non-minimal CBOR encoding" in str(rejected(enc, ArtifactFormatError))


@pytest.mark.parametrize("field", sorted(HEADER))
def test_duplicate_header_key_signed_by_trusted_key(field):
    "Each header key repeated (cbor2 would keep the last one), signed by the trusted key: refused, naming the key."
    raw = cbor2.dumps(HEADER, canonical=True)
    dup = bytes([raw[0] + 1]) + raw[1:] + cbor2.dumps(field) + cbor2.dumps(HEADER[field])
    art = cbor2.dumps([MAGIC, 1, dup, PAYLOAD, key_id(KEY), KEY.sign(signed_message(1, dup))], canonical=True)
    assert f"duplicate CBOR map key {field!r}" in str(rejected(art, ArtifactFormatError))


def test_duplicate_key_in_nested_map():
    h = dict(HEADER)
    raw = cbor2.dumps(h, canonical=True)
    fp = cbor2.dumps(h["fingerprint"], canonical=True)
    dup_fp = bytes([fp[0] + 1]) + fp[1:] + cbor2.dumps("os") + cbor2.dumps("Plan9")
    bad = raw.replace(fp, dup_fp)
    assert bad != raw
    art = cbor2.dumps([MAGIC, 1, bad, PAYLOAD, key_id(KEY), KEY.sign(signed_message(1, bad))], canonical=True)
    assert "duplicate CBOR map key 'os'" in str(rejected(art, ArtifactFormatError))


@fuzz(100)
@given(st.binary(min_size=1, max_size=16))
def test_trailing_bytes_in_signed_header(tail):
    raw = cbor2.dumps(HEADER, canonical=True) + tail
    art = cbor2.dumps([MAGIC, 1, raw, PAYLOAD, key_id(KEY), KEY.sign(signed_message(1, raw))], canonical=True)
    rejected(art, ArtifactFormatError)


@fuzz(100)
@given(st.binary(min_size=1, max_size=16))
def test_trailing_bytes_after_artifact(tail):
    assert "trailing bytes" in str(rejected(VALID + tail, ArtifactFormatError))


# --- special files: refused by type, never read without bound, never blocked on --------------------------------
def _within(seconds: float, fn):
    "fn() in a daemon thread; fail if it has not returned within `seconds` (a read without bound, or a blocked open)."
    out = {}
    def run():
        try: out["value"] = fn()
        except BaseException as e: out["error"] = e
    t = threading.Thread(target=run, daemon=True); t.start(); t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    return out


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_device_files_refused(path):
    if not os.path.exists(path): pytest.skip(f"{path} does not exist here")
    out = _within(10, lambda: verify_artifact(path, trusted_keys=TRUST))
    assert isinstance(out.get("error"), ArtifactFileError), out
    assert "not a regular file (a device)" in str(out["error"])


def test_fifo_refused_without_blocking(tmp_path):
    fifo = tmp_path / "a.sdxa"
    os.mkfifo(fifo)
    out = _within(10, lambda: verify_artifact(fifo, trusted_keys=TRUST))     # nobody writes: an open() would block
    assert isinstance(out.get("error"), ArtifactFileError) and "not a regular file (a FIFO)" in str(out["error"]), out


def test_directory_and_missing_file_refused(tmp_path):
    assert "is a folder, not a file" in str(rejected(tmp_path, ArtifactFileError))
    assert "no such file" in str(rejected(tmp_path / "none.sdxa", ArtifactFileError))


def test_regular_file_round_trip(tmp_path):
    (tmp_path / "a.sdxa").write_bytes(VALID)
    assert verify_artifact(tmp_path / "a.sdxa", trusted_keys=TRUST).payload == PAYLOAD


# --- misuse of the API: always an ArtifactError (ArtifactUsageError), one line ---------------------------------
@pytest.mark.parametrize("keys,msg", [
    (None, "trusted_keys is None"), (42, "found int"), ([None], "found NoneType"), ([KEY, 3.5], "found float"),
    ({"x": KEY.public_key()}, "to a key whose id is not 'x'"), ({key_id(KEY): "pem"}, "found str"),
    (b"-----BEGIN PUBLIC KEY-----", "found bytes"),
])
def test_trusted_keys_misuse(keys, msg):
    e = rejected(VALID, ArtifactUsageError, trusted_keys=keys)
    assert msg in str(e) and "\n" not in str(e)


def test_trusted_keys_forms_that_work(tmp_path):
    from static_dist.artifact import save_public_key
    pem = save_public_key(KEY, tmp_path / "k.pub")
    for keys in (
        KEY,
        KEY.public_key(),
        [KEY],
        (KEY.public_key(),),
        {key_id(KEY): KEY.public_key()},
        str(pem),
        pem,
        [pem],
    ):
        assert verify_artifact(VALID, trusted_keys=keys).payload == PAYLOAD


def test_trusted_keys_file_errors(tmp_path):
    from static_dist.artifact import ArtifactKeyError
    (tmp_path / "junk.pem").write_text("hello")
    rejected(VALID, ArtifactKeyError, trusted_keys=tmp_path / "junk.pem")
    rejected(VALID, ArtifactKeyError, trusted_keys=tmp_path / "missing.pem")
    rejected(VALID, ArtifactKeyError, trusted_keys=tmp_path)


@pytest.mark.parametrize("kw,msg", [
    (dict(data=123), "data must be artifact bytes or a path"), (dict(device=1.5), "device must be a Fingerprint"),
    (dict(device="nonsense"), "cannot fingerprint device"), (dict(policy=[1]), "policy must map"),
    (dict(policy={"*": 5}), "policy must map"),
])
def test_verify_misuse(kw, msg):
    data = kw.pop("data", VALID)
    assert msg in str(rejected(data, ArtifactUsageError, **kw))


@pytest.mark.parametrize("kw,msg", [
    (dict(payload="text"), "payload must be bytes"), (dict(signing_key=KEY.public_key()), "signing_key must be an "
                                                                                          "Ed25519 private"),
    (dict(signing_key=None), "signing_key must be"), (dict(meta={"a": 1}), "meta must map strings to strings"),
    (dict(meta={1: "a"}), "meta must map strings to strings"), (dict(meta=["a=b"]), "meta must be a dict"),
    (dict(meta={"a": None}), "meta must map strings to strings"), (dict(device=object()), "device must be a "
                                                                                          "Fingerprint"),
    (dict(version="1"), "version must be an int"), (dict(policy="strict"), "policy must map"),
])
def test_sign_misuse(kw, msg):
    args = {"payload": PAYLOAD, "signing_key": KEY, **kw}
    with pytest.raises(ArtifactUsageError, match=msg):
        sign_payload(args.pop("payload"), **args)


def test_fingerprint_fields_must_be_strings():
    with pytest.raises(ArtifactUsageError, match="fingerprint field 'torch' must be a string"):
        Fingerprint("cpu", "x", "Linux", "x86_64", 2)
    with pytest.raises(ArtifactUsageError, match="exactly the string fields"):
        Fingerprint.from_json('{"device_type": "cpu"}')


def test_sign_only_real_export_archives(tmp_path):
    import zipfile
    from static_dist.artifact import NotExportedProgramError, check_exported_program, save_artifact
    check_exported_program(PAYLOAD)
    z = io.BytesIO()
    with zipfile.ZipFile(z, "w") as f: f.writestr("archive/archive_format", "pt2")     # the marker, but no model
    for fake in (b"PK\x03\x04" + bytes(100), z.getvalue(), b"not a zip"):
        with pytest.raises(NotExportedProgramError):
            check_exported_program(fake, "p.pt2")
    with pytest.raises(ArtifactUsageError, match="must be a torch.export.ExportedProgram"):
        save_artifact(PAYLOAD, tmp_path / "a.sdxa", signing_key=KEY)


def test_save_artifact_atomic_and_force(tmp_path):
    from static_dist.artifact import save_artifact
    from static_dist.errors import StaticDistError
    ep = torch.export.load(io.BytesIO(PAYLOAD))
    p = save_artifact(ep, tmp_path / "a.sdxa", signing_key=KEY)
    before = p.read_bytes()
    with pytest.raises(StaticDistError, match="exists"):
        save_artifact(ep, p, signing_key=KEY, force=False)
    assert p.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["a.sdxa"]      # untouched, no temp left
    with pytest.raises(StaticDistError, match="is a folder"):
        save_artifact(ep, tmp_path, signing_key=KEY)
    assert sorted(os.listdir(tmp_path)) == ["a.sdxa"]
