"""The wheel as a new user meets it.

  python_wheel_test.py build BUILD_DIR   `pip wheel .` of this tree into BUILD_DIR/wheelhouse, at
                                         BUILD_DIR's build type (incremental: scikit-build-core
                                         keeps BUILD_DIR-wheel, and ccache shares BUILD_DIR's objects)
  python_wheel_test.py fresh BUILD_DIR   a new virtual environment, `pip install` of that wheel
                                         and nothing else (its dependencies at their newest), then
                                         the README's Python example
  python_wheel_test.py floor BUILD_DIR   the same at the oldest dependencies the wheel declares,
                                         plus the SDK's API and op suites against its daemons
  python_wheel_test.py demo BUILD_DIR    a fresh clone, configured, building only what
                                         scripts/demo.sh builds that makes the SDK importable (its
                                         target list must name the stubs), then the README's Python
                                         example with the clone's SDK, as .venv runs it after the demo

The example runs from an empty folder with no TESSEL_* variables, no
PYTHONPATH and the environment's bin/ off $PATH: the daemons it starts must be
the wheel's, found beside the interpreter. Its printed weights are checked
against the same loop in numpy.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import venv

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The oldest releases the wheel declares (pyproject.toml's dependencies).
FLOOR = ["grpcio==1.51.1", "protobuf==4.21.1", "numpy==1.24.0", "ml_dtypes==0.3.0"]


def run(cmd, **kw):
    print("+", " ".join(map(str, cmd)), flush=True)
    done = subprocess.run(list(map(str, cmd)), **kw)
    if done.returncode != 0:
        sys.exit(f"exit status {done.returncode}: {' '.join(map(str, cmd))}\n{done.stdout or ''}{done.stderr or ''}")
    return done


def the_wheel(build):
    wheels = sorted((build / "wheelhouse").glob("tessel-*.whl"))
    if len(wheels) != 1:
        sys.exit(f"expected one tessel wheel in {build / 'wheelhouse'}, found {[w.name for w in wheels]}")
    return wheels[0]


def cached(build, name, default):
    """A setting of BUILD_DIR's CMakeCache.txt (CMAKE_BUILD_TYPE, CMAKE_GENERATOR)."""
    cache = (build / "CMakeCache.txt").read_text()
    found = re.search(rf"^{name}:[A-Z]+=(.*)$", cache, re.M)
    return found.group(1) if found and found.group(1) else default


def build_wheel(build):
    """The wheel, built by scikit-build-core at BUILD_DIR's build type, with
    its compiler and its generator (Make's compile in each target's folder, Ninja's at the
    top: the paths ccache hashes differ between them), in a folder beside
    it at the same depth (BUILD_DIR-wheel), so ccache (CMakeLists.txt)
    serves it the objects BUILD_DIR compiled; only what the wheel's
    settings change (TESSEL_CUDA=OFF, no tests) compiles anew."""
    house = build / "wheelhouse"
    shutil.rmtree(house, ignore_errors=True)
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "-C",
            f"build-dir={build.parent / (build.name + '-wheel')}",
            "-C",
            f"cmake.build-type={cached(build, 'CMAKE_BUILD_TYPE', 'Release')}",
            "-w",
            house,
            ROOT,
        ],
        env=dict(
            os.environ,
            CMAKE_GENERATOR=cached(build, "CMAKE_GENERATOR", "Unix Makefiles"),
            # the same compiler by the same name: ccache hashes the name it is called by
            CXX=cached(build, "CMAKE_CXX_COMPILER", "c++"),
            CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1),
        ),
    )
    wheel = the_wheel(build)
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    for need in ("tessel/__init__.py", "tessel/v1/session_pb2.py", "tessel/v1/session_pb2_grpc.py"):
        assert need in names, f"{wheel.name} lacks {need}"
    for cmd in ("tessel", "tessel-coordinator", "tessel-worker"):
        assert any(n.endswith(f".data/scripts/{cmd}") for n in names), f"{wheel.name} lacks the command {cmd}"
    print(f"{wheel.name}: {wheel.stat().st_size} bytes, the SDK with its stubs and the three commands")


def new_env(build, name, packages):
    env_dir = build / "pyenvs" / name
    shutil.rmtree(env_dir, ignore_errors=True)
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages])
    return env_dir, py


def readme_example():
    text = (ROOT / "README.md").read_text()
    python = text[text.index("\n## Python\n") :]
    return re.search(r"```python\n(.*?)```", python, re.S).group(1)


def clean_environment(env_dir):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TESSEL_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env["PATH"] = os.pathsep.join(
        p
        for p in env.get("PATH", "").split(os.pathsep)
        if p
        and pathlib.Path(p).resolve() != (env_dir / "bin").resolve()
        and not (pathlib.Path(p) / "tessel-worker").exists()
    )
    return env


def check_example(env_dir, py):
    work = env_dir / "work"
    work.mkdir()
    (work / "example.py").write_text(readme_example())
    out = run(
        [py, "example.py"], cwd=work, env=clean_environment(env_dir), capture_output=True, text=True, timeout=300
    ).stdout
    print(out[-1500:])
    # The same loop in numpy: w <- w - 0.1 * mean_rows(tanh(x @ w)), 1000 times.
    w = np.eye(4, dtype=np.float32)
    x = np.ones((8, 4), np.float32)
    for _ in range(1000):
        w = w - np.float32(0.1) * np.tanh(x @ w).mean(axis=0)
    printed = out[out.rindex("[[") :]
    got = np.array(
        [float(v) for v in re.findall(r"[-+]?\d*\.\d+(?:[eE][-+]?\d+)?|[-+]?\d+", printed)[:16]], np.float32
    ).reshape(4, 4)
    np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)
    # Both arguments donated on every step: 2 x 1000 buffers reused in place.
    receipts = next(line for line in out.splitlines() if "'reused'" in line)
    assert "'reused': False" not in receipts and receipts.rstrip().endswith("] 2000"), receipts
    print("README example: weights match numpy's loop; 2000 donations reused")


def check_demo(build):
    """The demo command leaves the SDK importable: a fresh clone, configured,
    building only the Python stubs, which demo.sh must name among its
    targets (the rest it builds, the daemons and the demo, are the ones in
    BUILD_DIR), runs the README's example with the clone's SDK."""
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    targets = re.search(r"scripts/setup\.sh --target (.*)", demo).group(1).split()
    assert "tessel_python_stubs" in targets, f"scripts/demo.sh builds {targets}: not the SDK's stubs"
    clone = build / "demo-clone"
    shutil.rmtree(clone, ignore_errors=True)
    run(["git", "clone", "-q", ROOT, clone])
    run(["cmake", "-S", clone, "-B", clone / "build", f"-DPython3_EXECUTABLE={sys.executable}"], capture_output=True)
    run(["cmake", "--build", clone / "build", "--target", "tessel_python_stubs"], capture_output=True)
    work = clone / "work"
    work.mkdir()
    sdk = clone / "client" / "python"
    # The clone's SDK (PYTHONPATH comes before the .venv's path to this tree).
    (work / "example.py").write_text(
        f"import tessel\nassert tessel.__file__.startswith({str(sdk)!r}), tessel.__file__\n" + readme_example()
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSEL_") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(sdk), TESSEL_BIN_DIR=str(build / "bin"))
    out = run([sys.executable, "example.py"], cwd=work, env=env, capture_output=True, text=True, timeout=300).stdout
    assert "[[" in out, out
    shutil.rmtree(clone, ignore_errors=True)
    print("demo: the README's Python example ran with the SDK of a fresh clone after demo.sh's targets")


def main():
    mode, build = sys.argv[1], pathlib.Path(sys.argv[2]).resolve()
    if mode == "demo":
        check_demo(build)
        return
    if mode == "build":
        build_wheel(build)
        return
    wheel = the_wheel(build)
    if mode == "fresh":
        env_dir, py = new_env(build, "fresh", [wheel])
        for cmd in (["tessel-coordinator", "--version"], ["tessel-worker", "--version"], ["tessel", "help"]):
            run([env_dir / "bin" / cmd[0], *cmd[1:]], capture_output=True)
        check_example(env_dir, py)
    elif mode == "floor":
        env_dir, py = new_env(build, "floor", ["--only-binary", ":all:", *FLOOR, "pytest"])
        run([py, "-m", "pip", "install", "-q", "--no-deps", wheel])
        versions = run(
            [
                py,
                "-c",
                "import grpc, google.protobuf as p, numpy, ml_dtypes; "
                "print(grpc.__version__, p.__version__, numpy.__version__, ml_dtypes.__version__)",
            ],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert versions == [f.split("==")[1] for f in FLOOR], f"expected {FLOOR}, the environment has {versions}"
        check_example(env_dir, py)
        env = dict(clean_environment(env_dir), TESSEL_BIN_DIR=str(env_dir / "bin"))
        run(
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                ROOT / "client/python/tests/test_api.py",
                ROOT / "client/python/tests/test_ops.py",
            ],
            cwd=env_dir,
            env=env,
        )
    else:
        sys.exit(f"mode: expected build, fresh, floor or demo, got {mode!r}")


if __name__ == "__main__":
    main()
