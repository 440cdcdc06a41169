"""Every file dslaunch writes goes through ``dslaunch.safe_write``: a walk of the package source
(``dslaunch/``, ``launcher/``, ``runtime/``, ``kernels/``) with ``ast`` finds each call that could
create, replace or write a file or directory, and fails on any outside the module or ``ALLOWED``.

A new writer either calls ``safe_write`` or earns an entry in ``ALLOWED`` with its reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dslaunch", "launcher", "runtime", "kernels")
MODULE = "dslaunch/safe_write.py"

# (file, enclosing function, call) -> why it may write without safe_write.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("launcher/agent/spare.py", "_autogroup_nice", "open(w)"):
        "a kernel interface file (/proc/<pid>/autogroup), not a file on disk",
    ("runtime/autotuning.py", "reset_peak_memory", "open(w)"):
        "a kernel interface file (/proc/self/clear_refs), not a file on disk",
    ("launcher/cli/__init__.py", "_reader_gone", "os.open(write)"):
        "opens /dev/null for writing: a device, never created",
    ("runtime/inference/shm_allreduce.py", "_create", "os.open(write)"):
        "a shared-memory segment in /dev/shm created with O_CREAT|O_EXCL (never an existing file), "
        "its name unpredictable; not a file written on the user's behalf",
    ("runtime/inference/shm_allreduce.py", "map_segment", "os.open(write)"):
        "attaches O_RDWR (no O_CREAT) to the segment rank 0 created",
    ("runtime/zero/offload/swap.py", "_open_anonymous", "os.open(write)"):
        "an unnamed O_TMPFILE (or O_EXCL, unlinked at once) swap file: no name another user can plant",
    ("runtime/profiling/mfu.py", "_one_at_a_time", "os.open(write)"):
        "the peak cache's lock file in the private (0700) cache directory, O_NOFOLLOW; only flock'ed, never written",
    ("kernels/cpu/build.py", "_compile", "os.replace"):
        "the compiler needs a file name: it writes a mkstemp file (created exclusively) in the cache "
        "directory checked by check_owner, renamed by descriptor (dir_fd) onto the library",
    ("runtime/checkpoint/save_load.py", "<lambda>", "torch.save"):
        "writes the path safe_write.atomic_path (via store.write_atomic) just created exclusively",
    ("runtime/checkpoint/deepspeed_pickle.py", "to_bytes", "torch.save"):
        "serializes into an io.BytesIO in memory; the callers write the bytes through safe_write (write_file, or format.write_object's create_new)",
    ("runtime/checkpoint_engine/torch_checkpoint_engine.py", "save", "torch.save"):
        "writes the path safe_write.atomic_path just created exclusively, renamed onto the target",
    ("runtime/checkpoint/export.py", "<lambda>", "torch.save"):
        "writes the path safe_write.atomic_path (via store.write_atomic) just created exclusively",
    ("runtime/checkpoint/export.py", "<lambda>", "save_file"):
        "safetensors writes the path safe_write.atomic_path (via store.write_atomic) just created exclusively",
    ("kernels/cpu/build.py", "_compile", "tempfile.mkstemp"):
        "the compiler's output file, created exclusively (0600) in the checked cache directory",
    ("kernels/cpu/build.py", "_build_fd", "tempfile.mkdtemp"):
        "a fresh private (0700) build directory when the cache cannot be used; created exclusively",
    ("runtime/checkpoint/export.py", "<lambda>", "write_text"):
        "writes the path safe_write.atomic_path (via store.write_atomic) just created exclusively",
    ("runtime/checkpoint/publish.py", "<lambda>", "write_text"):
        "writes the path safe_write.atomic_path (via store.write_atomic) just created exclusively",
    ("runtime/checkpoint/publish.py", "<lambda>", "write_bytes"):
        "writes the path safe_write.atomic_path (via store.write_atomic) just created exclusively",
    ("runtime/checkpoint/publish.py", "_move_into_place", "os.rename"):
        "renames between entries of save_dir, which LeaderSave.begin accepted by safe_write's rule "
        "(this user's, not writable by others); rename replaces a link at its target, never follows it",
    ("runtime/checkpoint/publish.py", "_undo_install", "os.rename"):
        "as _move_into_place: inside the checked save_dir",
    ("runtime/checkpoint/store.py", "discard", "os.rename"):
        "moves a directory of the checked save_dir to .trash-<random> before deleting it",
    ("runtime/checkpoint/leftovers.py", "clear", "os.rename"):
        "moves a tag's own .old-<tag> back inside the checked save_dir",
}

_WRITE_MODES = set("wax+")
_CREATING_FLAGS = {"O_CREAT", "O_WRONLY", "O_RDWR", "O_TRUNC", "O_APPEND", "O_TMPFILE"}
_PATH_WRITES = {"mkdir", "makedirs", "rename", "renames", "write_text", "write_bytes", "touch", "symlink_to",
                "hardlink_to"}
_SHUTIL = {"copy", "copy2", "copyfile", "copytree", "move", "copymode", "copystat"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _mode(call: ast.Call, position: int) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == "mode":
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _writes_mode(mode: ast.AST | None) -> bool:
    """An ``open`` mode that writes (a mode not known statically counts as one)."""
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return bool(_WRITE_MODES & set(mode.value))
    return True


def write_call(call: ast.Call) -> str | None:
    """What kind of write ``call`` is, or None."""
    func = call.func
    owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
    if isinstance(func, ast.Name) and func.id == "open":
        return "open(w)" if _writes_mode(_mode(call, 1)) else None
    if isinstance(func, ast.Name) and func.id == "save_file":  # safetensors
        return "save_file"
    if not isinstance(func, ast.Attribute):
        return None
    name = func.attr
    if owner == "os" and name == "open":
        flags = call.args[1] if len(call.args) > 1 else None
        written = flags is not None and (_CREATING_FLAGS & _names(flags) or isinstance(flags, ast.Name))
        return "os.open(write)" if written else None
    if owner == "os" and name in ("replace", "rename", "renames", "mkdir", "makedirs", "symlink", "link"):
        return f"os.{name}"
    if owner == "shutil" and name in _SHUTIL:
        return f"shutil.{name}"
    if owner == "torch" and name == "save":
        return "torch.save"
    if owner == "tempfile" and name in ("mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory"):
        return f"tempfile.{name}"
    if owner == "io" and name == "open":
        return "open(w)" if _writes_mode(_mode(call, 1)) else None
    if name == "open" and owner != "os":  # Path.open(mode)
        return "open(w)" if _writes_mode(_mode(call, 0)) else None
    if name in _PATH_WRITES:
        return name
    return None


def found_writes() -> Iterator[tuple[str, str, str, int]]:
    """(file, enclosing function, kind, line) of every write call in the package source."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), rel)
            yield from _walk(tree, rel, "<module>")


def _walk(node: ast.AST, rel: str, where: str) -> Iterator[tuple[str, str, str, int]]:
    for child in ast.iter_child_nodes(node):
        inner = where
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = child.name
        elif isinstance(child, ast.Lambda):
            inner = "<lambda>"
        if isinstance(child, ast.Call) and (kind := write_call(child)):
            yield rel, inner, kind, child.lineno
        yield from _walk(child, rel, inner)


def test_every_write_goes_through_safe_write_or_is_allowed_with_a_reason():
    found = list(found_writes())
    stray = [f"{rel}:{line} in {fn}: {kind}" for rel, fn, kind, line in found
             if rel != MODULE and (rel, fn, kind) not in ALLOWED]
    assert not stray, ("writes outside dslaunch/safe_write.py: call safe_write (open_dir, write_file, "
                       "append_file, atomic_path, ...) or add an ALLOWED entry with its reason:\n  "
                       + "\n  ".join(stray))
    used = {(rel, fn, kind) for rel, fn, kind, _ in found}
    unused = sorted(set(ALLOWED) - used)
    assert not unused, f"ALLOWED entries that match no call any more (remove them): {unused}"
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_walk_finds_each_kind_of_write():
    """The detector itself: each form of write in a snippet is found, reads are not."""
    src = """
def f(p, fd, flags):
    open(p, "w"); open(p, mode="ab"); open(p, m); open(p); open(p, "rb")
    os.open(p, os.O_WRONLY | os.O_CREAT); os.open(p, flags); os.open(p, os.O_RDONLY)
    os.makedirs(p); p.mkdir(); os.replace(p, q); os.rename(p, q); "a".replace("a", "b")
    shutil.copyfile(p, q); shutil.move(p, q); shutil.rmtree(p)
    p.write_text("x"); p.write_bytes(b""); p.open("w"); p.open(); torch.save(x, p)
    tempfile.mkstemp(); save_file(d, p)
"""
    kinds = [kind for _, _, kind, _ in _walk(ast.parse(src), "x.py", "")]
    assert kinds == ["open(w)", "open(w)", "open(w)", "os.open(write)", "os.open(write)", "os.makedirs",
                     "mkdir", "os.replace", "os.rename", "shutil.copyfile", "shutil.move", "write_text",
                     "write_bytes", "open(w)", "torch.save", "tempfile.mkstemp", "save_file"]
