import pytest

from hf import build

_folders: dict = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """``folder(kind)``: the base model's folder, as ``save_pretrained`` writes it (several shards); each
    kind written once in the session, for the peft tests of this folder."""

    def get(kind: str) -> str:
        if kind not in _folders:
            path = str(tmp_path_factory.mktemp(f"base-{kind}"))
            build(kind).save_pretrained(path, max_shard_size="20KB")
            _folders[kind] = path
        return _folders[kind]

    return get
