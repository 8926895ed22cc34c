"""Run model-written code (the ``python`` task's grader, :func:`.tasks.run_python_tests`) confined: this file is run
as a script (``python -I confined.py``, the code on stdin), outside its package, so it imports only the standard
library.

The limits are against accidents (a runaway loop, a huge list, a fork bomb, a file that fills the disk), not a
sandbox against a hostile model: the code can still read what the user running the grader can, write small
files, and use the network (docs/configuration.md, "The psd command").
"""

from __future__ import annotations

import sys

# The limits model-written code runs under (``_confine``).
GRADER_CPU_S = 2  # CPU seconds (RLIMIT_CPU); the wall-clock ``timeout`` applies as well
GRADER_MEMORY = 512 << 20  # bytes of address space (RLIMIT_AS)
GRADER_FILE_SIZE = 1 << 20  # the largest file it may write (RLIMIT_FSIZE); a larger write fails with EFBIG


# The seccomp filter's numbers per machine: AUDIT_ARCH, then the system calls clone, clone3, and those refused
# outright (fork, vfork, execve, execveat; arm64 has no fork or vfork).
_SECCOMP = {
    "x86_64": (0xC000003E, 56, 435, (57, 58, 59, 322)),
    "aarch64": (0xC00000B7, 220, 435, (221, 281)),
}


def _forbid_new_processes() -> bool:
    """Install a seccomp filter on this process: clone without ``CLONE_THREAD``, fork, vfork, execve and execveat
    fail with EPERM, so no child process can start and no program can be run. Threads still start: clone3, whose
    flags sit in memory a filter cannot read, answers ENOSYS, so libc falls back to clone, whose flags it can.
    RLIMIT_NPROC alone would not do: root is exempt from it. False where no filter could be installed (another OS
    or machine, seccomp off)."""
    import ctypes
    import errno
    import platform

    if sys.platform != "linux" or platform.machine() not in _SECCOMP:
        return False
    arch, clone, clone3, refused = _SECCOMP[platform.machine()]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF: load word (absolute), jumps, return
    allow, deny, nosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny),  # another ABI (i386 on x86_64): nothing at all
            (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, deny),  # x32 numbers
            (jeq, 0, 1, clone3), (ret, 0, 0, nosys)]
    for nr in refused:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, deny)]
    prog += [(jeq, 0, 2, clone), (ld, 0, 0, 16), (jset, 0, 1, 0x00010000),  # clone: its flags (args[0]) hold
             (ret, 0, 0, allow), (ret, 0, 0, deny)]  # CLONE_THREAD or it is refused

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(prog))(*prog)
    fprog = SockFprog(len(prog), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, which a filter needs without CAP_SYS_ADMIN
        return False
    return libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _confine() -> None:
    """Confine this process before it runs model-written code: no new processes (``_forbid_new_processes``, else
    RLIMIT_NPROC 0, which binds all but root), CPU time, address space and file size limited, no core files.
    A limit the platform refuses is skipped: these are limits against accidents, not a sandbox."""
    import resource

    limits = [(resource.RLIMIT_CPU, GRADER_CPU_S, GRADER_CPU_S + 1),  # SIGXCPU at the first, SIGKILL at the second
              (resource.RLIMIT_AS, GRADER_MEMORY, GRADER_MEMORY),
              (resource.RLIMIT_FSIZE, GRADER_FILE_SIZE, GRADER_FILE_SIZE),
              (resource.RLIMIT_CORE, 0, 0)]
    if not _forbid_new_processes():
        limits.append((resource.RLIMIT_NPROC, 0, 0))  # also stops threads, where it binds at all
    for which, soft, hard in limits:
        _, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            pass


def run_confined() -> None:
    """The grader's child (``python -I confined.py``): read the candidate from stdin, confine this process, then
    run the candidate as ``python -c`` would (a fresh ``__main__``, ``sys.argv == ["-c"]``, an uncaught exception
    exits 1), so a grade is what it was when the code ran unconfined."""
    import builtins
    import types

    src = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
    _confine()
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    exec(compile(src, "<string>", "exec", dont_inherit=True), main.__dict__)  # not this file's __future__ flags


if __name__ == "__main__":
    run_confined()
