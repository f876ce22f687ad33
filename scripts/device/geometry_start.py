"""Does a dummy geometry's server start, and in how much memory? One server, started and stopped,
with the device e2e geometry test's flags (test/e2e/test_geometries.py) plus the ones given after
``--``: for telling a start-up failure of Minima's from SGLang's own. (2026-12-03: the
qwen3.6-27b-class e2e server ran out of GPU memory while SGLang captured breakable prefill graphs.)

  python3 scripts/device/geometry_start.py qwen3.6-27b-class --module sglang.launch_server \
      --out $OUT/qwen_sglang.txt -- --attention-backend flashinfer           # SGLang's own defaults
  python3 scripts/device/geometry_start.py qwen3.6-27b-class --out $OUT/qwen_minima.txt \
      -- --cuda-graph-backend-prefill breakable                              # Minima's launcher

Writes whether it came up (and in how many seconds) or how it ended, and the log's memory lines.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test"))

from minima_test_support.dummy_models import GEOMETRIES, make_model, serve_flags  # noqa: E402
from minima_test_support.server import launch  # noqa: E402

MEMORY_LINES = re.compile(r"avail mem|Memory pool|KV Cache is|Mamba Cache|Capture .* begin|Capture .* end|"
                          r"OutOfMemoryError|out of memory")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("geometry", choices=sorted(GEOMETRIES))
    ap.add_argument("--module", default="sglang_minima.launch_server", help="the server's module")
    ap.add_argument("--out", type=Path, required=True)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--": the server's flags
    args = ap.parse_args(argv[:cut])
    extra = argv[cut + 1 :]
    from sglang_minima.models import ensure_default_model

    work = Path(tempfile.mkdtemp(prefix="geometry-"))
    model = make_model(args.geometry, work / "models", ensure_default_model())
    flags = [*serve_flags(model), *extra]
    log = work / "server.log"
    try:
        server = launch(flags, log, module=args.module)
    except RuntimeError as e:
        verdict = f"did not start: {str(e).splitlines()[0]}"
    else:
        verdict = f"started in {server.startup_s:.0f} s"
        server.stop()
    lines = [line.rstrip() for line in log.read_text(errors="replace").splitlines() if MEMORY_LINES.search(line)]
    report = "\n".join([f"{args.module} {args.geometry} {' '.join(flags[2:])}", verdict, *lines]) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    return 0 if verdict.startswith("started") else 1


if __name__ == "__main__":
    sys.exit(main())
