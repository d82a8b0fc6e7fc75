"""AMX tile data for the engine processes kvsvc's integrations are loaded into.

Linux hands a process Intel AMX's tile registers only after the process asked for them
(arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); the first tile instruction of a
process that never asked dies with SIGILL. vLLM 0.32's CPU attention kernels use AMX
for bf16 (blocks of a multiple of 32) without asking: they work only once something
else asked first (oneDNN does, for a multi-token bf16 GEMM). An engine whose first
forward is one token -- every PD decode engine's, since its first step recomputes one
token -- dies there. request_amx() asks, once per process, before the engine's first
forward; where the CPU has no AMX, or this is not x86-64 Linux, it does nothing.

The permission is the process's (every thread's), and fork keeps it.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import platform
import sys
import threading

log = logging.getLogger(__name__)

# <asm/prctl.h> and <asm/unistd_64.h> on x86-64.
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

CPUINFO = "/proc/cpuinfo"


class AmxPermission(enum.Enum):
    NOT_APPLICABLE = "not applicable"  # no AMX on this CPU, or not x86-64 Linux
    HELD = "held"  # the kernel lets this process use AMX tile data
    REFUSED = "refused"  # asked, and the kernel said no (logged with errno)


_lock = threading.Lock()
_result: AmxPermission | None = None


def cpu_has_amx(cpuinfo: str = CPUINFO) -> bool:
    """Whether the CPU advertises AMX tiles (the amx_tile flag of /proc/cpuinfo)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split(":", 1)[-1].split()
    except OSError:
        return False
    return False


def _x86_64_linux() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def _arch_prctl(code: int, arg: int | ctypes.c_ulong) -> tuple[int, int]:
    """(return value, errno) of arch_prctl(code, arg) through libc's syscall()."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    value = ctypes.byref(arg) if isinstance(arg, ctypes.c_ulong) else ctypes.c_ulong(arg)
    rc = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), value)
    return int(rc), ctypes.get_errno()


def amx_permitted() -> bool | None:
    """Whether this process may use AMX tile data now (ARCH_GET_XCOMP_PERM); None where
    the question does not apply (not x86-64 Linux, or a kernel without the call)."""
    if not _x86_64_linux():
        return None
    mask = ctypes.c_ulong(0)
    rc, _ = _arch_prctl(ARCH_GET_XCOMP_PERM, mask)
    if rc != 0:
        return None
    return bool(mask.value & (1 << XFEATURE_XTILEDATA))


def request_amx(cpuinfo: str = CPUINFO) -> AmxPermission:
    """Ask Linux for AMX tile data for this process, where the CPU has AMX; once per
    process (later calls return the first answer). Logged once; never raises."""
    global _result
    with _lock:
        if _result is None:
            _result = _request(cpuinfo)
        return _result


def _request(cpuinfo: str) -> AmxPermission:
    if not _x86_64_linux() or not cpu_has_amx(cpuinfo):
        return AmxPermission.NOT_APPLICABLE
    if amx_permitted():
        log.info("kvsvc: AMX tile data already permitted in this process")
        return AmxPermission.HELD
    rc, errno = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if rc != 0 or not amx_permitted():
        log.warning("kvsvc: the CPU has AMX but Linux refused this process AMX tile data (arch_prctl errno %d); "
                    "bf16 attention kernels that use AMX may die with SIGILL", errno)
        return AmxPermission.REFUSED
    log.info("kvsvc: AMX tile data permitted in this process (ARCH_REQ_XCOMP_PERM), before its first forward")
    return AmxPermission.HELD


def _reset_for_tests() -> None:
    global _result
    with _lock:
        _result = None
