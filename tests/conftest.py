from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from factories import build_checkpoint, build_tokenizer  # noqa: E402
from shared_ray import SharedRay  # noqa: E402

# a skip for a missing or broken dependency fails the run (tests/skip_guard.py says why)
pytest_plugins = ["skip_guard"]


def _import_triton_for_its_interpreter() -> None:
    """Triton's CPU interpreter works only if ``triton`` was first imported with ``TRITON_INTERPRET=1`` (its own
    ``@jit`` helpers are decorated at import). Test modules collected before tests/kernel_checks may import it without
    (llguidance.torch -> torch._dynamo -> triton, in a grammar test), so on a machine without CUDA it is imported
    here, before any test module, under the variable, which is then removed again (tests/kernel_checks/conftest.py
    explains)."""
    import importlib.util
    import os

    import torch

    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None or "triton" in sys.modules:
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_import_triton_for_its_interpreter()

# two pytest-xdist workers start clusters at once: each cluster would pin its first actor's engine thread to CPU 0
# (cluster/launcher.py local_cpu_sets). Tests of the pinning itself unset this while they start their cluster.
os.environ.setdefault("PDCLUSTER_PIN_CPUS", "0")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    """``tiny_checkpoint(arch, **overrides) -> folder``, memoized per argument set."""
    made: dict[tuple, Path] = {}

    def make(arch: str, **overrides) -> Path:
        key = (arch, repr(sorted(overrides.items(), key=str)))  # repr: list-valued overrides (mlp_only_layers)
        if key not in made:
            made[key] = build_checkpoint(tmp_path_factory.mktemp(arch), arch, tiny_tokenizer_dir, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def offline_default():  # type: ignore[no-untyped-def]
    """The offline engine on the default model as the served tests compare with it (float32: EXACT_DTYPE, 0.25 GiB of
    K/V), built once per pytest process instead of once per module (~5 s of CPU each: torch, transformers' config
    imports, 135M weights). Greedy and seeded answers do not depend on what it ran before (tests/unit/test_llm_api.py
    and the served tests' equality with it check that)."""
    from engine import LLM
    from factories import EXACT_DTYPE

    llm = LLM("default", dtype=EXACT_DTYPE, kv_cache_gib=0.25)
    yield llm
    llm.close()


SHARED_RAY = pytest.StashKey[SharedRay]()  # this pytest process's shared local Ray (tests/shared_ray.py)
LOCAL_RAY_MODULES = pytest.StashKey[set]()  # node ids of the modules with a test that asks for `local_ray`


def pytest_configure(config: pytest.Config) -> None:
    config.stash[SHARED_RAY] = SharedRay()


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures, which may start a Ray of their own
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test in a module none of whose tests asks for ``local_ray`` runs with no shared Ray up."""
    if _module_id(item) not in item.config.stash.get(LOCAL_RAY_MODULES, set()):
        item.config.stash[SHARED_RAY].shutdown()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The modules with a test that asks for the shared local Ray, among the tests that run; a test in any other module
    runs with none up (pytest_runtest_setup)."""
    session.config.stash[LOCAL_RAY_MODULES] = {_module_id(i) for i in session.items if "local_ray" in i.fixturenames}


def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[SHARED_RAY].shutdown()


@pytest.fixture(scope="module")
def local_ray(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """A local Ray for a module's clusters: each ``Cluster(cfg, local_ray=True)`` runs on it and its stop leaves it up
    (cluster/local_ray.py). The modules that ask share one per pytest process (tests/shared_ray.py: started by the
    first, kept up for the next, a fresh one after a module that left actors behind), saving a Ray start and stop
    (~7 s of CPU on two cores) per module after the first (tests/conftest.py runs them one after another). Offers 6
    CPUs: the largest cluster a module starts (actors x CPUs each + 1, as serve's own embedded Ray would)."""
    pytest.importorskip("ray")
    shared = request.config.stash[SHARED_RAY]
    shared.ensure()
    try:
        yield
    finally:
        shared.release()


# -- tiers -----------------------------------------------------------------------------------------------------------
# Every test CI runs is in exactly one tier, decided here and nowhere else:
#   fast:        pure code: no subprocess, no Ray, no server process, no model bigger than the tiny factory ones.
#                tests/unit and tests/kernel_checks, less the tests listed in INTEGRATION below.
#                `python3 -m pytest -m fast -n 2` (~1,510 tests; 3.8 min wall on two cores with pytest-xdist, ~5.5 serial,
#                2026-12-03).
#   integration: the rest that CI runs: tests/integration, tests/helm, the unit tests listed in INTEGRATION, and any
#                test marked @pytest.mark.integration (a test may also say @pytest.mark.fast itself).
#                CI runs it with the fast tier in one session on two pytest-xdist workers (.ci/run), then the tests
#                marked `alone` (they judge rates they measure on this machine) by themselves.
#   slow:        marked @pytest.mark.slow; neither CI nor a plain `pytest` runs it (pyproject's addopts).
# A plain `python3 -m pytest` runs fast + integration, one test at a time.
FOLDER_TIERS = {"unit": "fast", "kernel_checks": "fast", "integration": "integration", "helm": "integration"}
TIERS = ("fast", "integration")
# Tests in a fast folder that start a process, Ray, a server process or the default model: "file" for all its tests,
# "file::test" for one (all its parameters), "file::test[params]" for one case; each with why.
INTEGRATION = {
    "tests/unit/test_benchmark_scripts.py": "runs the benchmark scripts as subprocesses",
    "tests/unit/test_cli.py": "runs `pdcluster` as a subprocess, the default model included",
    **{f"tests/unit/test_default_model.py::{t}": "converts the default model (135M) into a fresh cache, ~30 s"
       for t in ("test_conversion_reports_progress", "test_converted_folder_contents",
                 "test_chat_template_renders_chatml", "test_second_resolve_does_not_reconvert",
                 "test_existing_hf_folder_is_returned")},
    **{f"tests/unit/test_detokenizer.py::{t}": "the default model's tokenizer (converted first where absent)"
       for t in ("test_smollm2_tokenizer_matches_decode", "test_smollm2_takes_the_rust_backend_with_the_same_text")},
    "tests/unit/test_evacuate.py::test_evacuate_waits_for_a_sigtermed_process_to_exit": "signals a child process",
    "tests/unit/test_evacuate.py::test_evacuate_reports_what_outlived_the_timeout": "signals a child process",
    "tests/unit/test_gpu_check_smoke.py": "runs scripts/gpu_check.sh --smoke",
    "tests/unit/test_llm_api.py": "the default model (SmolLM2-135M) against Hugging Face",
    "tests/unit/test_openai_protocol.py::test_proxy_modules_do_not_import_torch": "a fresh interpreter",
    "tests/unit/test_prompt_tokenizer.py::test_no_torch_import": "a fresh interpreter",
    "tests/unit/test_quant_fused.py::test_fresh_build_is_timed_and_quick": "runs the C++ compiler (a fresh build)",
    "tests/unit/test_prompt_tokenizer.py::test_matches_transformers[default]": "the default model (converted once)",
    "tests/unit/test_hf_tokenizer.py::test_default_model_takes_the_direct_path_and_loads_what_auto_loads":
        "the default model (converted once)",
    "tests/unit/test_ray_address.py::test_cli_scale_on_dead_address_exits_fast": "runs `pdcluster` as a subprocess",
    "tests/unit/test_reliability_scripts.py::test_descendants_and_rss_of_a_real_child": "a child process",
    "tests/kernel_checks/test_bench_smoke.py": "runs benchmarks/bench_kernels.py as a subprocess",
    "tests/kernel_checks/test_compile_sm90.py": "compiles every kernel in a subprocess",
}


def _tier_of(item: pytest.Item, rel: str) -> str | None:
    """The tier of one collected test: None for slow and GPU-only tests (no tier: CI never runs them)."""
    if item.get_closest_marker("slow") or item.get_closest_marker("gpu"):
        return None
    for tier in TIERS:
        if item.get_closest_marker(tier):
            return tier
    if rel in INTEGRATION or item.nodeid.split("[")[0] in INTEGRATION or item.nodeid in INTEGRATION:
        return "integration"
    parts = rel.split("/")
    return FOLDER_TIERS.get(parts[1], "integration") if len(parts) > 2 and parts[0] == "tests" else "integration"


# Files of long subprocess tests (each starts torch, transformers or a cluster in fresh processes: minutes on loaded
# cores): they go first in the run (_run_order), instead of ending it on one worker while the other idles (tests
# otherwise go in collection order, and these come near its end).
LONG_FILES = frozenset({
    "tests/unit/test_gpu_check_smoke.py",  # the gpu-check smokes
    "tests/integration/test_gpu_kv_check_smoke.py",
    "tests/integration/test_gpu_serve_check_smoke.py",
    "tests/unit/test_benchmark_scripts.py",
})


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module-scoped fixture (a served cluster, the module's local Ray, a converted model):
    such a module's tests belong on one pytest-xdist worker, or each worker running some of them builds it again."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection, which then sees the tier markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    seen_files, seen_keys = set(), set()
    order: dict[str, int] = {}  # nodeid -> where it goes in the run (_run_order)
    ray_modules = {_module_id(i) for i in items if "local_ray" in i.fixturenames}  # (before `-m` deselects)
    for item in items:
        rel = _rel(item, root)
        seen_files.add(rel)
        seen_keys.update((rel, item.nodeid.split("[")[0], item.nodeid))
        tier = _tier_of(item, rel)
        if tier is not None and not item.get_closest_marker(tier):
            item.add_marker(tier)
        shared = _uses_a_module_fixture(item)
        order[item.nodeid] = _run_order(item, rel, shared, _module_id(item) in ray_modules)
        # under `-n N --dist loadgroup` (.ci/run) a module whose tests share a module-scoped fixture runs on one
        # worker (as one unit of work); every other test goes to whichever worker is free
        if item.get_closest_marker("xdist_group"):
            continue
        if shared:
            item.add_marker(pytest.mark.xdist_group(rel))
    # an entry that names a test no longer there (renamed, moved) would silently put nothing in the integration tier
    # (only when whole files were collected: not under -k or a `file::test` argument)
    whole_files = not config.getoption("keyword") and not any("::" in str(a) for a in config.args)
    stale = [k for k in INTEGRATION if k.split("::")[0] in seen_files and k not in seen_keys]
    if stale and whole_files:
        raise pytest.UsageError(f"tests/conftest.py INTEGRATION names tests that do not exist: {stale}")
    gone = [f for f in LONG_FILES if not (root / f).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py LONG_FILES names files that do not exist: {gone}")
    items.sort(key=lambda item: order[item.nodeid])  # stable: a file's tests keep their order


def _rel(item: pytest.Item, root: Path) -> str:
    return Path(str(item.path)).resolve().relative_to(root).as_posix() if item.path else item.nodeid


def _module_id(item: pytest.Item) -> str:
    module = item.getparent(pytest.Module)
    return module.nodeid if module is not None else item.nodeid


def _run_order(item: pytest.Item, rel: str, shared: bool, on_shared_ray: bool) -> int:
    """Where a test goes in the run: the long subprocess files first, then the integration modules that run on the
    shared local Ray (one after another, so that a worker passes its Ray from one to the next: tests/shared_ray.py),
    then the rest of the integration tier, then the fast tier's modules that share a module-scoped fixture (one unit
    of work each, some a minute long), then the other fast tests. CI runs both tiers in one pytest-xdist session
    (.ci/run, ``--dist loadgroup --no-loadscope-reorder``: work goes out in this order), so the many short fast tests
    come last and fill the end of the run, where one worker would otherwise idle while the other finishes a long
    unit."""
    if rel in LONG_FILES:
        return 0
    if item.get_closest_marker("integration"):
        return 1 if on_shared_ray else 2
    return 3 if shared else 4  # shared: the test uses a module-scoped fixture
