"""benchmark/quality/ruler_data.py's generate(): arms side by side asking for the same examples at
once get one generation, and a generation cut short leaves nothing a later run would read.

RULER's generator itself is replaced by a fake that writes its validation.jsonl slowly, line by
line, and logs each run: the lock and the rename are what is under test, not RULER."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path.cwd() / "benchmark" / "quality"))
import ruler_data as rd

cache, fail = Path(sys.argv[1]), sys.argv[2] == "fail"

def fake_run(cmd, **kwargs):
    save_dir = Path(cmd[cmd.index("--save_dir") + 1])
    with open(cache / "runs.log", "a") as log:
        log.write(f"{save_dir.name}\n")
    out = save_dir / cmd[cmd.index("--save_name") + 1] / "validation.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for i in range(int(cmd[cmd.index("--num_samples") + 1])):
            f.write(json.dumps({"index": i, "input": f"prompt {i}", "outputs": [str(i)], "length": 100 + i}))
            f.flush()
            time.sleep(0.05)  # a reader that did not wait would find a partial line
            if fail and i == 1:
                raise subprocess.CalledProcessError(1, cmd)
            f.write("\n")

import subprocess
rd.subprocess.run = fake_run
rd.ensure_generator = lambda cache_dir: (cache_dir, cache_dir)
try:
    examples = rd.generate("niah_single_1", 1024, 4, Path("tok"), cache_dir=cache)
    print(json.dumps([[e.index, e.prompt, e.outputs, e.prompt_tokens] for e in examples]))
except subprocess.CalledProcessError:
    print(json.dumps("failed"))
"""


def _generate(cache: Path, mode: str, n: int) -> list:
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(cache), mode], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_processes_side_by_side_share_one_generation(tmp_path):
    got = _generate(tmp_path, "ok", 4)
    assert (tmp_path / "runs.log").read_text().splitlines() == ["niah_single_1_1024_n4_s42.partial"]
    expected = [[i, f"prompt {i}", [str(i)], 100 + i] for i in range(4)]
    assert got == [expected] * 4
    # a later run reads the folder the rename made, without generating again
    assert _generate(tmp_path, "ok", 1) == [expected]
    assert len((tmp_path / "runs.log").read_text().splitlines()) == 1
    assert not (tmp_path / "data" / "niah_single_1_1024_n4_s42.partial").exists()


def test_a_generation_cut_short_is_not_read_as_the_examples(tmp_path):
    assert _generate(tmp_path, "fail", 1) == ["failed"]
    assert not (tmp_path / "data" / "niah_single_1_1024_n4_s42").exists()  # only the scratch folder
    got = _generate(tmp_path, "ok", 1)  # the next run generates again, from scratch
    assert got == [[[i, f"prompt {i}", [str(i)], 100 + i] for i in range(4)]]
    assert len((tmp_path / "runs.log").read_text().splitlines()) == 2
