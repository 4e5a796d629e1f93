import json

from recipes import prepare_data
from tests.conftest import write_text_files


def test_cli_prepares_user_text(tmp_path, capsys):
    src = write_text_files(tmp_path / "mine", n=6, words=80)
    code = prepare_data.main(["--input", str(src / "*.txt"), "--output", str(tmp_path / "out"), "--seq-len", "16", "--vocab-size", "280"])
    assert code == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["seq_len"] == 16 and manifest["splits"]["train"]["tokens"] > 0
    assert "data.seq_len=16" in capsys.readouterr().out


def test_cli_missing_input_is_one_line(tmp_path, capsys):
    code = prepare_data.main(["--input", str(tmp_path / "none*.txt"), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: no input files match") and "\n" not in err
