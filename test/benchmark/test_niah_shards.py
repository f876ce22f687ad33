"""NIAH_SHARDS: how `run_suite.sh niah` spreads each arm's eight RULER tasks over processes
(benchmark/quality/niah_shards.py), and the suite's side-by-side launcher run on it with a stand-in
script (the device is the only other place this bash runs)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "quality"))

import niah_shards  # noqa: E402
from ruler_data import TASKS  # noqa: E402

ARMS = ["fp8", "bf16", "minima-default-aggressive-eqbytes"]


def test_one_count_for_every_arm_or_counts_per_arm():
    assert niah_shards.counts("2", ARMS) == dict.fromkeys(ARMS, 2)
    assert niah_shards.counts("1,minima-default-aggressive-eqbytes=5", ARMS) == {
        "fp8": 1, "bf16": 1, "minima-default-aggressive-eqbytes": 5}


def test_each_arms_processes_take_every_task_once_round_robin():
    plan = niah_shards.plan("1,minima-default-aggressive-eqbytes=3,bf16=20", ARMS)
    assert [f for a, f in plan if a == "fp8"] == [""]  # one process: no --tasks, every task
    for arm, n in [("minima-default-aggressive-eqbytes", 3), ("bf16", len(TASKS))]:  # 20: one a task at most
        shares = [f.removeprefix("--tasks ").split(",") for a, f in plan if a == arm]
        assert len(shares) == n and sorted(t for s in shares for t in s) == sorted(TASKS)
        assert shares[0] == list(TASKS)[::n]


@pytest.mark.parametrize("spec, message", [
    ("0", "the default '0' is not a count"), ("two", "the default 'two' is not a count"),
    ("1,minima=2", "'minima' is not one of NIAH_ARMS"), ("1,fp8", "give ARM=COUNT"),
    ("1,fp8=-1", "fp8 '-1' is not a count")])
def test_a_bad_spec_is_refused_naming_the_entry(spec, message):
    with pytest.raises(SystemExit, match=message):
        niah_shards.plan(spec, ARMS)


def test_the_suites_launcher_starts_one_process_a_line_with_its_own_port_and_log(tmp_path):
    launcher = subprocess.run(["sed", "-n", "/^arms_side_by_side() {/,/^}/p", str(ROOT / "scripts/device/run_suite.sh")],
                              capture_output=True, text=True, check=True).stdout
    assert launcher.startswith("arms_side_by_side()")
    (tmp_path / "stub.py").write_text("import sys; print(' '.join(sys.argv[1:]))\n")
    script = f"""set -uo pipefail
{launcher}
WORK={tmp_path}; left=30
arms=fp8,minima-default-aggressive-eqbytes
processes=$(cd {ROOT}/benchmark/quality && {sys.executable} niah_shards.py 1,minima-default-aggressive-eqbytes=2 "$arms")
arms_side_by_side {tmp_path}/stub.py niah 31800 --out o
echo "ref=$ref"
unset processes; arms=bf16,,minima-nostale,  # stray commas: no empty arm
arms_side_by_side {tmp_path}/stub.py ppl 32400 --out p
"""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # python3: this one
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "ref=fp8"
    logs = {p.name: p.read_text().split() for p in tmp_path.glob("*.log")}
    assert sorted(logs) == ["niah_fp8.log", "niah_minima-default-aggressive-eqbytes_0.log",
                            "niah_minima-default-aggressive-eqbytes_1.log", "ppl_bf16.log", "ppl_minima-nostale.log"]
    assert logs["niah_fp8.log"] == ["--arms", "fp8", "--reference", "fp8", "--port", "31800", "--out", "o"]
    shard1 = logs["niah_minima-default-aggressive-eqbytes_1.log"]
    assert shard1[5] == "31840" and shard1[-2:] == ["--tasks", ",".join(list(TASKS)[1::2])]
    assert logs["ppl_minima-nostale.log"][5] == "32420"  # no plan: one process an arm
