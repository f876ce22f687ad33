from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_minima import launch_server
from sglang_minima.config import CONFIG_ENV
from sglang_minima.launch_server import LaunchError, check_supported


def _args(**overrides):
    base = dict(radix_cache_backend="minima", page_size=64, speculative_algorithm=None,
                enable_hierarchical_cache=False, disaggregation_mode="null", dcp_size=1)
    return SimpleNamespace(**{**base, **overrides})


@pytest.fixture(autouse=True)
def _isolated_config_env(monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, "")  # prepare() selects Minima process-wide; restore afterwards


def test_defaults_select_minima_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(launch_server, "_cuda_available", lambda: False)
    monkeypatch.setattr("sglang_minima.cpu_engine.setup_cpu_engine", lambda: None)
    config, argv = launch_server.prepare(["--model-path", str(tmp_path), "--minima-recent-pages", "2"])
    assert config.recent_pages == 2
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--device"] == "cpu"
    assert flags["--attention-backend"] == "minima_native"
    assert flags["--radix-cache-backend"] == "minima"
    assert flags["--page-size"] == "64"
    assert flags["--max-total-tokens"] == str(launch_server.CPU_DEFAULT_MAX_TOTAL_TOKENS)
    assert not any(a.startswith("--minima-") for a in argv)


def test_defaults_on_gpu_serve_the_kernels_with_decode_graphs(monkeypatch, tmp_path):
    monkeypatch.setattr(launch_server, "_cuda_available", lambda: True)
    _, argv = launch_server.prepare(["--model-path", str(tmp_path)])
    flags = dict(zip(argv[::2], argv[1::2]))
    assert "--device" not in flags and "--max-total-tokens" not in flags
    assert flags["--attention-backend"] == "minima"
    # decode graphs: SGLang's default (full); extend batches are planned on the host
    assert "--cuda-graph-backend-decode" not in flags and flags["--cuda-graph-backend-prefill"] == "disabled"


@pytest.mark.parametrize("key_flags", [["--minima-key-bits", "4"], ["--minima-key-center"]])
def test_key_formats_on_gpu_serve_the_kernels(monkeypatch, tmp_path, key_flags):
    monkeypatch.setattr(launch_server, "_cuda_available", lambda: True)
    _, argv = launch_server.prepare(["--model-path", str(tmp_path), *key_flags])
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--attention-backend"] == "minima" and "--cuda-graph-backend-decode" not in flags


@pytest.mark.parametrize("minima_flags", [["--minima-hot-dtype", "auto"], ["--minima-attention-score-anchors"],
                                         ["--minima-anchor-window", "64", "--minima-anchor-pages", "4"],
                                         ["--minima-value-code", "lloyd-max"],
                                         ["--minima-value-bits", "4"]])
@pytest.mark.parametrize("backend_flag", ["--attention-backend", "--decode-attention-backend",
                                          "--prefill-attention-backend"])
def test_gpu_flags_the_kernels_cannot_serve_select_the_torch_path(monkeypatch, tmp_path, minima_flags, backend_flag):
    monkeypatch.setattr(launch_server, "_cuda_available", lambda: True)
    _, argv = launch_server.prepare(["--model-path", str(tmp_path), *minima_flags])
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--attention-backend"] == "minima_native"
    assert flags["--cuda-graph-backend-decode"] == flags["--cuda-graph-backend-prefill"] == "disabled"
    with pytest.raises(LaunchError) as e:  # asked for explicitly, for either phase: refused, naming the flags
        launch_server.prepare(["--model-path", str(tmp_path), backend_flag, "minima", *minima_flags])
    assert minima_flags[0] in e.value.message and f"{backend_flag} minima" in e.value.message


@pytest.mark.parametrize("backend_flag", ["--attention-backend", "--decode-attention-backend",
                                          "--prefill-attention-backend"])
def test_kernel_backend_is_refused_on_cpu(monkeypatch, tmp_path, backend_flag):
    monkeypatch.setattr(launch_server, "_cuda_available", lambda: False)
    monkeypatch.setattr("sglang_minima.cpu_engine.setup_cpu_engine", lambda: None)
    with pytest.raises(LaunchError) as e:
        launch_server.prepare(["--model-path", str(tmp_path), backend_flag, "minima"])
    assert f"{backend_flag} minima runs the GPU kernels" in e.value.message


def test_kernel_backend_on_gpu_captures_decode_only(monkeypatch, tmp_path):
    monkeypatch.setattr(launch_server, "_cuda_available", lambda: True)
    _, argv = launch_server.prepare(["--model-path", str(tmp_path), "--attention-backend", "minima"])
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--attention-backend"] == "minima"
    assert "--cuda-graph-backend-decode" not in flags and flags["--cuda-graph-backend-prefill"] == "disabled"
    _, argv = launch_server.prepare(["--model-path", str(tmp_path), "--cuda-graph-backend-decode", "full"])
    assert argv.count("--cuda-graph-backend-decode") == 1  # the user's, accepted
    _, argv = launch_server.prepare(["--model-path", str(tmp_path), "--attention-backend", "minima_native"])
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--cuda-graph-backend-decode"] == flags["--cuda-graph-backend-prefill"] == "disabled"
    check_supported(_args(attention_backend="minima", decode_attention_backend="minima"))  # accepted


def test_graph_flags_of_the_user_win(monkeypatch, tmp_path):
    monkeypatch.setattr(launch_server, "_cuda_available", lambda: True)
    _, argv = launch_server.prepare(["--model-path", str(tmp_path), "--disable-cuda-graph"])
    assert not any(a.startswith("--cuda-graph-backend") for a in argv)


@pytest.mark.parametrize("flag", ["--attention-backend", "--prefill-attention-backend", "--decode-attention-backend"])
def test_non_minima_attention_backend_is_refused(flag):
    with pytest.raises(LaunchError) as exc:
        check_supported(_args(**{flag[2:].replace("-", "_"): "flashinfer"}))
    assert exc.value.message.startswith(flag) and "'flashinfer'" in exc.value.message


def test_user_flags_win_over_defaults(monkeypatch, tmp_path):
    monkeypatch.setattr("sglang_minima.cpu_engine.setup_cpu_engine", lambda: None)
    _, argv = launch_server.prepare(["--device", "cpu", "--model-path", str(tmp_path),
                                     "--page-size=16", "--max-total-tokens", "4096"])
    assert argv.count("--page-size") == 0 and "--page-size=16" in argv
    assert argv.count("--max-total-tokens") == 1


@pytest.mark.parametrize("overrides, flag", [
    ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm"),
    ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
    ({"disaggregation_mode": "prefill"}, "--disaggregation-mode"),
    ({"dcp_size": 2}, "--dcp-size"),
    ({"radix_cache_backend": None}, "--radix-cache-backend"),
    ({"page_size": 1}, "--page-size"),
    ({"page_size": 8}, "--page-size"),
    ({"page_size": 24}, "--page-size"),
])
def test_unsupported_combinations_name_the_flag(overrides, flag):
    with pytest.raises(LaunchError) as exc:
        check_supported(_args(**overrides))
    assert exc.value.message.startswith(flag)


@pytest.mark.parametrize("page_size", [1, 8, 24, 0])
def test_page_size_must_hold_whole_16_token_tiles(page_size):
    with pytest.raises(LaunchError) as exc:
        check_supported(_args(page_size=page_size))
    assert "multiple of 16" in exc.value.message and exc.value.message.endswith(f"got {page_size}")


@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_supported_args_pass(page_size):
    check_supported(_args(page_size=page_size))


def test_help_lists_minima_and_sglang_flags(monkeypatch, capsys):
    # --help prints both flag sets and returns without fetching a model or starting anything
    monkeypatch.setattr("sglang_minima.models.ensure_default_model", lambda: pytest.fail("--help fetched the model"))
    launch_server.main(["--help"])
    out = capsys.readouterr().out
    assert "--minima-recent-pages" in out and "--minima-disable-stale" in out
    assert out.index("--minima-recent-pages") < out.index("SGLang flags:")
    assert "--model-path" in out.split("SGLang flags:")[1] and "--page-size" in out


@pytest.mark.parametrize("other, flag, value", [
    ([], "--cuda-graph-backend-prefill", "full"),
    ([], "--cuda-graph-backend-decode", "breakable"),
    (["--attention-backend", "minima_native"], "--cuda-graph-backend-prefill", "breakable"),
    (["--prefill-attention-backend", "minima_native"], "--cuda-graph-backend-prefill", "breakable"),
    (["--attention-backend", "minima_native", "--decode-attention-backend", "minima"], "--cuda-graph-backend-prefill", "breakable"),
    (["--attention-backend", "minima_native"], "--cuda-graph-backend-decode", "full"),
    (["--minima-hot-dtype", "auto"], "--cuda-graph-backend-decode", "full"),  # picks minima_native
])
def test_cuda_graphs_minima_cannot_capture_are_refused_naming_the_flag(monkeypatch, tmp_path, other, flag, value):
    monkeypatch.setattr(launch_server, "_cuda_available", lambda: True)
    with pytest.raises(LaunchError) as e:
        launch_server.prepare(["--model-path", str(tmp_path), *other, f"{flag}={value}"])
    assert e.value.message.startswith(f"{flag} {value}:") and "disabled" in e.value.message
    launch_server.prepare(["--model-path", str(tmp_path), *other, flag, "disabled"])  # accepted


def test_breakable_prefill_graphs_are_passed_to_sglang_on_the_kernel_backend(monkeypatch, tmp_path):
    # SGLang's breakable prefill graphs run attention (and its metadata) eagerly between the
    # captured layers: the host-planned extend of ``minima`` serves inside them
    monkeypatch.setattr(launch_server, "_cuda_available", lambda: True)
    _, argv = launch_server.prepare(["--model-path", str(tmp_path), "--cuda-graph-backend-prefill", "breakable"])
    assert argv.count("--cuda-graph-backend-prefill") == 1
    assert argv[argv.index("--cuda-graph-backend-prefill") + 1] == "breakable"
    assert argv[argv.index("--attention-backend") + 1] == "minima"


def test_a_repeated_flag_is_read_as_sglang_reads_it_the_last_one(monkeypatch, tmp_path):
    # SGLang's argparse keeps the last value of a repeated flag: the launcher's checks and defaults
    # must look at that one, not the first
    monkeypatch.setattr(launch_server, "_cuda_available", lambda: True)
    monkeypatch.setattr("sglang_minima.cpu_engine.setup_cpu_engine", lambda: None)
    with pytest.raises(LaunchError) as refused:
        launch_server.prepare(["--model-path", str(tmp_path), "--device", "cuda", "--attention-backend",
                               "minima_native", "--device", "cpu", "--attention-backend=minima"])
    assert refused.value.message.startswith("--attention-backend minima runs the GPU kernels: on CPU")
    _, argv = launch_server.prepare(["--model-path", str(tmp_path), "--attention-backend", "minima",
                                     "--attention-backend", "minima_native"])
    # the torch path, so no decode graphs by default
    assert argv[argv.index("--cuda-graph-backend-decode") + 1] == "disabled"


def test_the_prefill_scratch_reserve_follows_the_flags_a_server_would_read():
    # what bench_capacity.py and niah.py leave out of a Minima pool at one byte budget: the one TQ3
    # tile the server keeps in its budget (8 KV heads x 16,384 tokens x 128 x 4 bytes on `minima`)
    def reserve(*argv: str, device: str = "cuda") -> int:
        return launch_server.prefill_scratch_reserve_for(list(argv), device, num_kv_heads=8, head_dim=128, page_size=64)

    assert reserve() == reserve("--decode-attention-backend", "minima_native") == 64 * 2**20
    assert reserve("--attention-backend", "minima_native") == reserve("--prefill-attention-backend=minima_native") == 0
    assert reserve("--attention-backend", "minima_native", "--attention-backend", "minima") == 64 * 2**20  # the last
    assert reserve(device="cpu") == reserve("--device", "cpu") == 0
    assert reserve("--minima-hot-dtype", "auto") == 0  # the kernels do not read model-dtype hot pages: minima_native
