"""`cachefuse profile-layers` (cachefuse/cli/profile_layers.py): the CLI writes the profile under the store,
where an engine on that store finds it; where to write it is checked before the model loads."""

from __future__ import annotations

import json

import pytest

from cachefuse.cli.main import main as cli_main
from cachefuse.config import CacheFuseConfig
from cachefuse.metadata.layer_profiles import LayerProfile, load_profile, with_profiled_layers


def test_cli_writes_the_profile_where_an_engine_on_the_store_finds_it(tiny_model_dir, tmp_path, capsys):
    from cachefuse.chunks import model_fingerprint

    model = tiny_model_dir("llama")
    store = tmp_path / "store"
    status = cli_main(["profile-layers", "--model", str(model), "--store", str(store), "--items", "4",
                       "--critical", "2", "--no-progress", "--json", "--plot", str(tmp_path / "profile.png")])
    assert status == 0 and (tmp_path / "profile.png").stat().st_size > 0
    printed = LayerProfile.from_dict(json.loads(capsys.readouterr().out))
    fingerprint = model_fingerprint(model)
    num_layers = len(printed.recall)
    assert load_profile(store, fingerprint, num_layers) == printed and len(printed.critical_layers) == 2
    config = with_profiled_layers(CacheFuseConfig(), store, fingerprint, num_layers)
    assert config.qcfuse_critical_layers == printed.critical_layers
    with pytest.raises(SystemExit):
        cli_main(["profile-layers", "--model", str(model)])  # written nowhere: refused before the model loads
    a_file = tmp_path / "afile"
    a_file.write_text("")
    for argv, message in ((["--store", str(a_file)], "not a directory"),  # checked before profiling, not after
                          (["--out", str(tmp_path / "none" / "p.json")], "no directory")):
        with pytest.raises(SystemExit) as exc:
            cli_main(["profile-layers", "--model", str(model), "--items", "1", *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
