"""The node verdict's disk reasons (agent/health.py): literal facts."""

from __future__ import annotations

from rankguard.agent.health import disk_reasons

MiB = 1 << 20


def fs(free: int, size: int = 32 * MiB, **kw) -> dict:
    return {"path": "/ckfs/ckpt", "mountpoint": "/ckfs", "fstype": "tmpfs",
            "free_bytes": free, "size_bytes": size, **kw}  # fmt: skip


def test_a_full_checkpoint_filesystem_is_named_with_the_kernels_words():
    (r,) = disk_reasons({"checkpoint": fs(0)})
    assert (r.code, r.severity) == ("checkpoint_disk_low", "unhealthy")
    assert r.message == (
        "checkpoint filesystem /ckfs (tmpfs) holding /ckfs/ckpt: full: no space left on device "
        "(0 B of 32.0 MiB)"
    )


def test_low_and_nearly_low_filesystems():
    (low,) = disk_reasons({"data": fs(MiB)})  # 3.1%
    assert low.severity == "unhealthy" and "3.1% free (1.0 MiB of 32.0 MiB)" in low.message
    (nearly,) = disk_reasons({"checkpoint": fs(3 * MiB)})  # 9.4%
    assert nearly.severity == "degraded" and nearly.message.startswith(
        "checkpoint filesystem /ckfs (tmpfs) holding /ckfs/ckpt: 9.4% free"
    )
    assert disk_reasons({"checkpoint": fs(4 * MiB)}) == []  # 12.5%: fine


def test_without_a_known_mount_the_directory_is_named():
    (r,) = disk_reasons({"checkpoint": fs(0, mountpoint="", fstype="")})
    assert r.message.startswith("checkpoint filesystem holding /ckfs/ckpt: full")


def test_an_unreadable_directory_and_an_empty_size():
    (r,) = disk_reasons({"checkpoint": {"path": "/x", "error": "OSError: gone"}})
    assert (r.code, r.severity) == ("checkpoint_dir_unreadable", "degraded")
    assert disk_reasons({"checkpoint": fs(0, size=0)}) == []
