"""`python -m vllm_dspine.pairs` reuses a folder only when it is complete: its record
matches the request and every file the record lists is there with its size."""

import json

from vllm_dspine.pairs.__main__ import RECORD, main


def test_a_folder_with_a_missing_file_is_made_again(tmp_path, capsys):
    out = tmp_path / "pair"
    assert main(["hybrid", "--out", str(out)]) == 0
    record = json.loads((out / RECORD).read_text())
    assert {k: v for k, v in record.items() if k != "files"} == {"name": "hybrid", "seed": 0}
    assert "draft/model.safetensors" in record["files"]
    assert "target/config.json" in record["files"]
    capsys.readouterr()

    assert main(["hybrid", "--out", str(out)]) == 0
    assert "reused" in capsys.readouterr().out

    (out / "draft" / "model.safetensors").unlink()  # the case pair.json alone hid
    assert main(["hybrid", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "draft/model.safetensors is missing" in said and "reused" not in said
    assert (out / "draft" / "model.safetensors").is_file()

    (out / "target" / "config.json").write_text("{}")  # a file changed under the record
    assert main(["hybrid", "--out", str(out)]) == 0
    assert "target/config.json has" in capsys.readouterr().out


def test_another_request_is_not_reused(tmp_path, capsys):
    out = tmp_path / "pair"
    assert main(["hybrid", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["hybrid", "--out", str(out), "--seed", "1"]) == 0
    said = capsys.readouterr().out
    assert "was written for" in said and "reused" not in said
    assert json.loads((out / RECORD).read_text())["seed"] == 1
