"""The README's Python blocks run as written, in order, on this machine (CPU: the reference
paths)."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_code_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)  # the Flax block writes a checkpoint file
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    out, lse = namespace["out"], namespace["lse"]
    assert out.shape == (2, 1, 512) and lse.shape == (16, 80)
    assert namespace["sparse_out"].shape == (2, 1, 16, 512)
    assert namespace["sparse_lse"].shape == (2, 16, 1)
    assert capsys.readouterr().out.strip().startswith("[")  # the popped tokens
