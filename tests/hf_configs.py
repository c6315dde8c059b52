"""`hf:` workload sources for the tests: a transformers config written to a folder (nothing downloaded)."""
import pytest


def hf_source(tmp_path_factory, config: str, **fields) -> str:
    "An `hf:` workload source: transformers' `config` class with `fields`, written here (nothing downloaded)."
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp(config.lower())
    getattr(transformers, config)(**fields).save_pretrained(d)
    return f"hf:{d / 'config.json'}"
