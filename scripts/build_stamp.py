"""The build stamp of scripts/run.sh: build ampx in place only when something it is built from changed.

    python scripts/build_stamp.py check    exit 0 if the last finished build still stands, else print
                                           why not (one line per reason) and exit 1
    python scripts/build_stamp.py begin    before a build: forget the last one, note the inputs now
    python scripts/build_stamp.py finish   after it: record it, with the artifacts it left

Run it with the Python the build is for (.venv/bin/python): it reads that interpreter's
site-packages for the CUDA 12 ptxas and the editable install.

The stamp (ampx/.build-stamp.json, beside the extension and the fatbin) holds a hash of every
input of the build (each file under csrc/ and cuda/, setup.py, pyproject.toml, the in-tree build
backend), the build settings (the AMPX_* and compiler variables, which nvcc, ptxas and C compiler
and their versions, the Python), taken before the build starts, and a hash of each artifact the
build left. It is removed before a build and written only after one finished, so a half-finished
or interrupted build, a source edited while it ran, an artifact changed or deleted since, or an
editable install that is gone never passes for a fresh build.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = os.path.join("ampx", ".build-stamp.json")
SOURCE_DIRS = ("csrc", "cuda", "build_backend")
SOURCE_FILES = ("setup.py", "pyproject.toml")
# Every variable setup.py (or the compiler setuptools calls) reads.
ENV_VARS = ("AMPX_CUDA", "AMPX_DEBUG", "AMPX_SANITIZE", "AMPX_NVCC", "AMPX_NVCC_FLAGS", "AMPX_PTXAS",
            "CUDA_HOME", "CUDA_PATH", "CC", "CFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED")
ARTIFACTS = ("_kernels.fatbin", "_kernels.json")


def file_hash(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tool_version(path):
    """What `path --version` prints (its whole text, so any change of release or build shows)."""
    try:
        run = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unrunnable: {e}"
    return " | ".join(ln.strip() for ln in (run.stdout + run.stderr).splitlines() if ln.strip())


def nvcc_candidates(env):
    """Every nvcc setup.py might pick (its find_nvcc order); all of them enter the stamp, so a
    change to any one rebuilds (cheaper than a stale fatbin)."""
    out = [env["AMPX_NVCC"]] if env.get("AMPX_NVCC") else []
    out += [os.path.join(env[v], "bin", "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if env.get(v)]
    out.append("/usr/local/cuda/bin/nvcc")
    on_path = shutil.which("nvcc", path=env.get("PATH"))
    if on_path:
        out.append(on_path)
    return [c for c in dict.fromkeys(out) if os.path.isfile(c) and os.access(c, os.X_OK)]


def ptxas_candidates(env):
    """The CUDA 12 ptxas setup.py would take ($AMPX_PTXAS, else nvidia-cuda-nvcc-cu12's)."""
    if env.get("AMPX_PTXAS"):
        return [env["AMPX_PTXAS"]] if os.path.isfile(env["AMPX_PTXAS"]) else []
    for base in sys.path:
        c = os.path.join(base or ".", "nvidia", "cuda_nvcc", "bin", "ptxas")
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return [c]
    return []


def build_inputs(root, env):
    """{name: digest or value} of everything the in-place build depends on."""
    inputs = {}
    files = [os.path.join(root, f) for f in SOURCE_FILES]
    for d in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, d)):
            dirnames[:] = sorted(n for n in dirnames if n != "__pycache__")
            files += [os.path.join(dirpath, n) for n in filenames if not n.endswith((".pyc", ".o"))]
    for path in sorted(files):
        if os.path.isfile(path):
            inputs["file " + os.path.relpath(path, root)] = file_hash(path)
    for var in ENV_VARS:
        inputs["env " + var] = env.get(var)
    cuda_off = (env.get("AMPX_CUDA") or "").strip().lower() in ("0", "no", "off", "false")
    if not cuda_off:
        for tool in nvcc_candidates(env) + ptxas_candidates(env):
            inputs["tool " + tool] = tool_version(tool)
    cc = (env.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    inputs["tool C compiler"] = tool_version(shutil.which(cc, path=env.get("PATH")) or cc)
    inputs["python"] = f"{sys.executable} {sys.version.split()[0]}"
    return inputs


def artifacts(root):
    """{path: digest} of what a build leaves in ampx/ (the extension, the fatbin and its record)."""
    pkg = os.path.join(root, "ampx")
    names = sorted(n for n in os.listdir(pkg) if (n.startswith("_C.") and n.endswith(".so")) or n in ARTIFACTS)
    return {os.path.join("ampx", n): file_hash(os.path.join(pkg, n)) for n in names}


def editable_install(root):
    """The tree this interpreter's ampx is an editable install of, or None."""
    try:
        text = metadata.distribution("ampx").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    info = json.loads(text or "{}")
    if not info.get("dir_info", {}).get("editable"):
        return None
    url = info.get("url", "")
    return os.path.realpath(url[len("file://"):]) if url.startswith("file://") else None


def reasons_to_build(root, env):
    """Why the in-place build must run (empty when the last one still stands)."""
    path = os.path.join(root, STAMP)
    try:
        with open(path) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return ["no finished build recorded"]
    now = build_inputs(root, env)
    old = stamp.get("inputs", {})
    why = [f"{k} changed" if k in old and k in now else f"{k} {'added' if k in now else 'removed'}"
           for k in sorted(set(old) | set(now)) if old.get(k) != now.get(k)]
    built = artifacts(root)
    for name, digest in stamp.get("artifacts", {}).items():
        if built.get(name) != digest:
            why.append(f"{name} {'changed since the build' if name in built else 'missing'}")
    if not stamp.get("artifacts"):
        why.append("the last build left no extension")
    if editable_install(root) != os.path.realpath(root):
        why.append(f"{sys.executable} has no editable install of this tree")
    return why


def begin_build(root, env):
    """Forgets the last build and notes the inputs of the one about to start: hashed now, before
    it reads them, so a source edited while it runs makes the next check rebuild."""
    path = os.path.join(root, STAMP)
    if os.path.exists(path):
        os.unlink(path)
    _write_json(path + ".pending", build_inputs(root, env))


def finish_build(root):
    """Records the build begun by begin_build as finished, with the artifacts it left."""
    path = os.path.join(root, STAMP)
    with open(path + ".pending") as f:
        inputs = json.load(f)
    _write_json(path, {"inputs": inputs, "artifacts": artifacts(root)})
    os.unlink(path + ".pending")


def _write_json(path, obj):
    """Atomically: a torn file never stands."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def main(argv):
    cmd = argv[0] if argv else ""
    if cmd == "check":
        why = reasons_to_build(ROOT, os.environ)
        for line in why[:8]:
            print(f"run.sh: rebuilding: {line}", file=sys.stderr)
        if len(why) > 8:
            print(f"run.sh: rebuilding: ... and {len(why) - 8} more", file=sys.stderr)
        return 1 if why else 0
    if cmd == "begin":
        begin_build(ROOT, os.environ)
        return 0
    if cmd == "finish":
        finish_build(ROOT)
        return 0
    print("usage: python scripts/build_stamp.py {check|begin|finish}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
