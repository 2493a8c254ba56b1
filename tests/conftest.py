"""Shared fixtures: 8 virtual CPU devices for JAX, tiny HF model dirs, one vLLM engine.

The environment variables must be set before jax or vllm is imported anywhere.
"""

import atexit
import gc
import os
import shutil
import tempfile

# The suite's programs are tiny and compile-bound. Optimization level 0: LLVM's passes are
# most of a compile (train_step_test: 103 s -> 73 s). XLA's older CPU fusion emitters: the
# newer MLIR ones cost more to compile (ten of the JAX test files: 298 -> 170 CPU seconds).
# Every comparison in the suite is between programs built with the same flags or against
# float64/independent references with arithmetic tolerances, so the numbers the tests check
# do not depend on them. The short binaries and peers the tests start keep them
# (tests/xla_env.py); a whole user-shaped run drops them (it runs more than it compiles).
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_cpu_use_fusion_emitters=false",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One in-process vLLM engine per test session, with a small KV cache: these machines have
# 2 cores and vLLM's CPU backend otherwise reserves most of a NUMA node.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One persistent XLA compilation cache for the whole session, inherited by every child
# process (the training binary, workers, multihost peers, xdist workers): they compile the
# same tiny-model functions, and a hit loads an executable instead of recompiling it. Tests
# that rebuild a jitted function in-process hit it too (the key is the HLO, not the Python
# object). Every compile is cached: on 2 busy cores even the small ones cost tens of ms.
# An explicit JAX_COMPILATION_CACHE_DIR (empty: no cache) wins.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="echo2_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # noqa: E402

from bridge.model import tiny_model  # noqa: E402


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Fail a test that changes torch's thread count: it is process-wide, and the session's
    vLLM engine, built for the count it started with, then fails its CPU attention kernel
    on every later request ("thread_num 2 vs. 1"), so tests after it fail instead."""
    import sys

    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    result = yield
    torch = sys.modules.get("torch")
    if before is not None and torch.get_num_threads() != before:
        after = torch.get_num_threads()
        torch.set_num_threads(before)
        pytest.fail(f"the test changed torch's process-wide thread count {before} -> {after}")
    return result


def pytest_collection_modifyitems(config, items):
    """Under xdist, the longest files first (tests/durations.py says why)."""
    if hasattr(config, "workerinput"):  # a serial run keeps file order (bisecting)
        from tests import durations

        durations.longest_files_first(items, durations.measured())


_cpu_at_last_file_end = [0.0]


def pytest_runtest_teardown(item, nextitem):
    """With ECHO2_TEST_RSS=FILE, append each test file's resident memory after its last
    test (MiB) and the CPU seconds it cost (this process plus the subprocesses it reaped):
    the suite runs on 2 xdist workers in 23 GiB and 2 cores, and what a file leaves alive
    (engines, compiled programs) stays for the rest of the worker's session."""
    if nextitem is not None and nextitem.path == item.path:
        return
    import gc
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
    path = os.environ.get("ECHO2_TEST_RSS")
    if not path:
        return
    with open("/proc/self/statm") as f:
        rss_mib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    cpu = sum(os.times()[:4])  # user + system, own and reaped children's
    cpu_s, _cpu_at_last_file_end[0] = cpu - _cpu_at_last_file_end[0], cpu
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {rss_mib:.0f} {cpu_s:.1f} {item.path}\n")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """family -> HF dir of a 2-layer tiny model (Qwen3 tied, Qwen2 with bias, Llama untied)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        fam: tiny_model.make_tiny_model(str(root / fam), tiny_model.tiny_config(fam), seed=i)
        for i, fam in enumerate(("qwen3", "qwen2", "llama"))
    }


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs):
    return tiny_model_dirs["qwen3"]


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """The session's one vLLM engine (a `VllmEngine`, fp32, eager) on the tiny Qwen3 model.

    Tests that swap weights into it must restore the original weights when done
    (see `rollout_gpu` swap tests) so test order does not matter.
    """
    import sys

    from rollout_gpu.vllm_engine import VllmEngine

    # vLLM's CPU kernel registration probes every loaded module's attributes; flask's
    # context-local proxies raise on that probe. Servers built on flask (moto) must run in
    # their own process.
    assert "flask" not in sys.modules, "flask was imported into the test process"

    engine = VllmEngine.start(tiny_model_dir, dtype="float32", max_model_len=256, seed=0)
    yield engine
    del engine


@pytest.fixture(scope="session")
def extra_vllm_engine():
    """Start another vLLM engine (a `VllmEngine`) that lives until the session ends.

    Tearing down one in-process engine destroys vLLM's process-wide parallel groups, which
    breaks every other engine still alive (the session engine): "pipeline model parallel
    group is not initialized". So no test engine is torn down before the process exits.
    """
    from rollout_gpu.vllm_engine import VllmEngine

    alive = []

    def start(model_dir: str, **kwargs):
        alive.append(VllmEngine.start(model_dir, **kwargs))
        return alive[-1]

    yield start


@pytest.fixture(scope="session")
def qwen3_chat_model_dir(tmp_path_factory):
    """A 2 x 64 tiny model over the real Qwen3-format tokenizer and chat template."""
    cfg = tiny_model.qwen3_config(num_layers=2, hidden_size=64, intermediate_size=128)
    path = str(tmp_path_factory.mktemp("qwen3_chat_model"))
    return tiny_model.make_tiny_model(path, cfg, tokenizer="qwen3")


@pytest.fixture(scope="session")
def qwen3_chat_engine(qwen3_chat_model_dir, extra_vllm_engine):
    """The session's one engine on that model: a Qwen3-vocabulary engine takes about a
    minute to start here, so every chat-format test shares it."""
    return extra_vllm_engine(qwen3_chat_model_dir, dtype="float32", max_model_len=1536, seed=0)


# No cyclic GC while the session imports every test module (jax, torch, vLLM, transformers:
# millions of long-lived objects), then those objects frozen out of every later collection:
# collecting the suite took 18.4 CPU seconds per process with the collector on, 14.7 off.
gc.disable()


def pytest_collection_finish(session):
    gc.freeze()
    gc.enable()


def pytest_unconfigure(config):
    gc.unfreeze()  # exit as without the freeze (nanobind reports objects alive at exit)
    gc.collect()
