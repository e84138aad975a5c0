"""The README's Python blocks run as written, in order, on this machine (CPU: the reference
paths), and every shape comment in them is true; the README stays short, its install lines copy-
paste on a fresh CPU machine and its test line says how long the tests take."""
import io
import pathlib
import re
import tokenize

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
# A shape comment: `# name (d0, d1, ...) [dtype]`, several per comment, comma-separated. Every
# tuple of integers in a comment must be one, so that none goes unchecked.
SHAPE = re.compile(r"([A-Za-z_]\w*) \((\d+(?:, \d+)*),?\)(?: ([a-z]+\d+\w*))?")
INT_TUPLE = re.compile(r"\(\d+(?:, \d+)*,?\)")


def shape_comments(source):
    """{line: [(name, shape, dtype or None)]} of the block's comments."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        claims = [(m[1], tuple(int(d) for d in m[2].split(", ")), m[3])
                  for m in SHAPE.finditer(token.string)]
        assert len(claims) == len(INT_TUPLE.findall(token.string)), (
            f"a shape in this comment names no array: {token.string!r}")
        if claims:
            found[token.start[0]] = claims
    return found


def run_checking_shapes(block, namespace):
    """Runs the block one top-level statement at a time; after each, checks the shape comments
    on its lines and on the comment lines after it. Returns how many claims were checked."""
    import ast

    import numpy as np

    claims = shape_comments(block)
    body = ast.parse(block).body
    checked = 0
    for i, statement in enumerate(body):
        exec(compile(ast.Module([statement], []), str(README), "exec"), namespace)
        end = body[i + 1].lineno if i + 1 < len(body) else len(block.splitlines()) + 1
        for line in range(statement.lineno, end):
            for name, shape, dtype in claims.pop(line, []):
                assert name in namespace, f"README line {line}: no array {name!r} here"
                value = namespace[name]
                assert tuple(value.shape) == shape, (name, value.shape, shape)
                if dtype is not None:
                    assert np.dtype(value.dtype) == np.dtype(dtype), (name, value.dtype, dtype)
                checked += 1
    assert not claims, f"shape comments before any statement: {claims}"
    return checked


def test_the_readme_code_runs_and_its_shape_comments_are_true(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)  # what the code writes, it writes into a temporary directory
    namespace = {}
    checked = sum(run_checking_shapes(block, namespace) for block in blocks)
    assert checked >= 8
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory
    assert namespace["lse"].shape == (16, 80)  # mla_prefill's lse: (heads, tokens)
    assert namespace["out"].shape == (2, 1, 512)  # the Flax layer's decode
    assert capsys.readouterr().out.strip().startswith("[")  # the popped tokens


def test_the_readme_is_short_and_copy_pastes():
    text = README.read_text()
    assert len(text.splitlines()) <= 180
    install = re.search(r"## Install\n.*?```bash\n(.*?)```", text, re.S)[1]
    assert "apt-get install -y g++ cmake" in install  # a C++ compiler and CMake
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in install  # CPU torch
    assert re.search(r"pytest.*# .*about \d+ minutes", install)  # how long the tests take


def test_the_readme_code_is_seeded():
    """Every random draw in the README is seeded: torch's by manual_seed, JAX's by its keys."""
    code = "".join(re.findall(r"```python\n(.*?)```", README.read_text(), re.S))
    assert "torch.manual_seed(" in code.split("DeepseekV3Attention(")[0]
    assert "np.random" not in code and "random.seed" not in code


def test_the_readme_points_at_files_that_exist():
    """Each repository path the README names (links, `docs/...`, `examples/...`, `ffi/...`)."""
    root = README.parent
    text = README.read_text()
    paths = set(re.findall(r"\]\(([^)#:]+)\)", text))
    paths |= set(re.findall(r"`((?:docs|examples|ffi|benchmarks)/[\w./-]+)`", text))
    assert len(paths) >= 5
    for path in paths:
        assert (root / path).exists(), path
