"""The pod's view of the machine: its network namespace, hostname, /etc/hosts, DNS and volumes.

`prepare()` writes the pod's files under its own directory and returns the command line that starts
the container: `nsenter --net` (the pod's network namespace, see `netns`) execs `pod_launcher` (new
mount, UTS and PID namespaces), whose child, PID 1 of the new PID namespace, runs a short shell
script that makes the mounts and then execs the container's argv. So, as in a container, the
container's process is PID 1: a signal it has no handler for (SIGTERM included) does nothing to
it, only SIGKILL does. With spec.shareProcessNamespace the script stays PID 1 (like the pod's
pause process) and runs the container's argv as its child, which then dies of SIGTERM by default.
Either way the exit status of the process the harness started is the container's (killed by
signal n: killed by n too, or exit code 128 + n), and the pod's processes are one process group.

The script, in the new mount namespace only (nothing leaks to the host's mounts):
- a volume mount point that does not exist on this machine (say /etc/lopa) is created inside an
  overlay mounted over its deepest existing ancestor directory (/etc), so the host's /etc is
  never written; a mount point nested in another volume's mount is created in that volume's files;
- every volume directory (or its subPath) is bind-mounted at its mountPath, remounted read-only when
  the mount says readOnly (ConfigMap, Secret, downwardAPI and projected volumes always are); a
  mount over the directory holding the pod's files (an emptyDir at /tmp) is made last, bringing the
  mounts nested in it along (`_bind_lines`);
- /etc/hosts (the kubelet's managed file: localhost and the pod's own name, its FQDN when it has a
  subdomain), /etc/resolv.conf (dnsPolicy ClusterFirst: the cluster DNS, the search list
  `<ns>.svc.cluster.local svc.cluster.local cluster.local`, ndots:5) and /etc/hostname are bound
  over the host's; the UTS hostname is the pod's hostname.

The code a pod runs (this checkout, its venv, the interpreter: HOST_CODE) stays where it is on the
host; a directory on the way to it that the pod's user may not enter (a checkout under /root, 0700)
is shown to the pod through an overlay that grants search, leaving the host's mode alone.

Where it differs from a container runtime: the root filesystem is the host's (no image), no IPC or
user namespace (the process runs as its pod's runAsUser, with its groups, through setpriv; as root
without one), no cgroup limits, /proc is remounted for the PID
namespace but /sys is the host's; every dnsPolicy is treated as ClusterFirst; a mount point
directly under / (say /models) is refused.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import sys
from collections.abc import Collection
from pathlib import Path

from .pod_plan import InitPlan, Mount, PodPlan, Unsupported, User

CLUSTER_DOMAIN = "cluster.local"
HOSTS_HEADER = """# Kubernetes-managed hosts file.
127.0.0.1\tlocalhost
::1\tlocalhost ip6-localhost ip6-loopback
fe00::0\tip6-localnet
fe00::0\tip6-mcastprefix
fe00::1\tip6-allnodes
fe00::2\tip6-allrouters
"""
READ_ONLY_KINDS = ("configMap", "secret", "downwardAPI", "projected")
LAUNCHER = Path(__file__).with_name("pod_launcher.py")
LAUNCHED = "launched"  # written by the "pause" shell once the container runs (shareProcessNamespace)
# What the container's process runs from on this host (an image would carry it): the repository
# (its editable packages, its venv) and the interpreter. A pod volume mounted over one of them (an
# emptyDir at /tmp over a clone in /tmp) must not hide it.
HOST_CODE = tuple(dict.fromkeys(Path(p).resolve() for p in (
    Path(__file__).resolve().parents[2], sys.prefix, sys.base_prefix)))


def _tool(name: str) -> str:
    found = shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if not found:
        raise Unsupported(f"the {name} command is missing")
    return found


def fqdn(plan: PodPlan) -> str:
    """The pod's own fully qualified name (hostname.subdomain.ns.svc.cluster.local), or ''."""
    if not plan.subdomain:
        return ""
    return f"{plan.hostname}.{plan.subdomain}.{plan.namespace}.svc.{CLUSTER_DOMAIN}"


def hosts_file(plan: PodPlan, pod_ip: str) -> str:
    names = [fqdn(plan), plan.hostname] if plan.subdomain else [plan.hostname]
    return HOSTS_HEADER + pod_ip + "\t" + "\t".join(names) + "\n"


def resolv_conf(namespace: str, dns_ip: str) -> str:
    search = f"{namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
    return f"search {search}\nnameserver {dns_ip}\noptions ndots:5\n"


def write_volumes(plan: PodPlan, pod_dir: Path, read_only: Collection[str] = ()) -> dict[str, Path]:
    """Writes every volume's files under pod_dir/volumes; returns volume name -> its directory.

    As the kubelet: an emptyDir (a volume not in `read_only`) is a directory anyone may write
    (0777); with the pod's fsGroup every volume's files and directories get that group, group read
    (and write, unless the volume is read-only), and the directories the setgid bit."""
    dirs: dict[str, Path] = {}
    for name, files in plan.volumes.items():
        root = pod_dir / "volumes" / name
        root.mkdir(parents=True, exist_ok=True)
        if name not in read_only:
            root.chmod(0o777)
        for relative, (content, mode) in files.items():
            target = root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            target.chmod(mode)
        if plan.fs_group is not None:
            _own(root, plan.fs_group, 0o440 if name in read_only else 0o660)
        dirs[name] = root
    return dirs


def claim_dirs(plan: PodPlan) -> dict[str, Path]:
    """The claims' directories (plan.host_dirs), owned by the pod's fsGroup as a volume driver that
    supports fsGroup makes them: group read and write, setgid directories."""
    if plan.fs_group is not None:
        for root in plan.host_dirs.values():
            _own(root, plan.fs_group, 0o660)
    return dict(plan.host_dirs)


def _own(root: Path, group: int, file_bits: int) -> None:
    """The kubelet's fsGroup ownership (SetVolumeOwnership) of one volume's tree."""
    for path in [root, *root.rglob("*")]:
        os.chown(path, -1, group)
        mode = path.stat().st_mode & 0o7777
        if path.is_dir():
            path.chmod(mode | file_bits | 0o110 | 0o2000)  # group enters, new files keep the group
        else:
            path.chmod(mode | file_bits)


def prepare(
    plan: PodPlan, pod_dir: Path, netns_path: Path, pod_ip: str, dns_ip: str, read_only: set[str],
    init: InitPlan | None = None,
) -> list[str]:
    """Writes the pod's files and returns the argv that starts its container process, or that of
    its init container `init`: the same network, volumes and files, that container's mounts.

    `read_only`: the volumes a kubelet always mounts read-only (see READ_ONLY_KINDS), and claims
    mounted readOnly.
    """
    pod_dir.mkdir(parents=True, exist_ok=True)
    volumes = {**write_volumes(plan, pod_dir, read_only), **claim_dirs(plan)}
    mounts, argv = (init.mounts, init.argv) if init else (plan.mounts, plan.argv)
    working_dir, share_pid = (init.working_dir, False) if init else (plan.working_dir, plan.share_pid)
    etc = pod_dir / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "hosts").write_text(hosts_file(plan, pod_ip))
    (etc / "resolv.conf").write_text(resolv_conf(plan.namespace, dns_ip))
    (etc / "hostname").write_text(plan.hostname + "\n")

    script = ["set -e"]
    binds: list[tuple[Path, str, bool]] = []
    for mount in sorted(mounts, key=lambda m: len(Path(m.path).parts)):
        if mount.volume not in volumes:
            raise Unsupported(f"volumeMount {mount.path}: no volume named {mount.volume!r}")
        source = volumes[mount.volume] / mount.sub_path if mount.sub_path else volumes[mount.volume]
        if mount.sub_path and not source.exists():
            source.mkdir(parents=True)  # the kubelet creates a missing subPath as a directory
        binds.append((source, mount.path, mount.read_only or mount.volume in read_only))
    for name in ("hosts", "resolv.conf", "hostname"):
        binds.append((etc / name, f"/etc/{name}", False))
    binds += _host_code_binds(binds)

    overlays: dict[Path, Path] = {}
    for source, target, _ in binds:
        parent = _enclosing_bind(target, binds)
        if parent is not None:  # nested in another volume: make the mount point in its files
            inner = parent[0] / os.path.relpath(target, parent[1])
            _make_point(inner, source)
        elif not Path(target).exists():
            ancestor = _existing_ancestor(target)
            if ancestor not in overlays:
                overlays[ancestor] = _overlay_dirs(pod_dir, len(overlays))
                upper, work = overlays[ancestor] / "upper", overlays[ancestor] / "work"
                options = f"lowerdir={ancestor},upperdir={upper},workdir={work}"
                script.append(f"mount -t overlay overlay -o {options} {ancestor}")
            script.append(f"{'mkdir -p' if source.is_dir() else 'touch'} {shlex.quote(target)}")
    run_as = init.user if init else plan.user
    script += _code_reachable_lines(run_as, pod_dir)
    # The pod's directory stays reachable through fd 9 whatever is mounted over it (say an emptyDir
    # at /tmp, where the harness keeps it).
    script.append(f"exec 9< {shlex.quote(str(pod_dir))}")
    script += _bind_lines(binds, pod_dir)
    script.append(f"hostname {shlex.quote(plan.hostname)}")
    script.append(f"cd {shlex.quote(working_dir)}")
    run = _as_user(run_as)
    if share_pid:  # PID 1 is the "pause" shell; it reaps the container and passes on its status
        # `echo` is a builtin (no child process): once the file exists, the only child is the container.
        script += [f'{run}"$@" 9<&- &', f"echo $! > /proc/self/fd/9/{LAUNCHED}", "wait $!", "exit $?"]
    else:
        script.append(f'exec {run}"$@" 9<&-')
    start = pod_dir / (f"init-{init.name}.sh" if init else "start.sh")
    start.write_text("\n".join(script) + "\n")
    return [
        _tool("nsenter"), f"--net={netns_path}", "--",
        sys.executable, "-I", "-S", str(LAUNCHER), str(start), *argv,
    ]


def _as_user(user: User | None) -> str:
    """The command prefix that runs a container as its user and groups ('' for root). setpriv
    execs the container in place, so it keeps the process's PID."""
    if user is None:
        return ""
    groups = f"--groups={','.join(map(str, user.groups))}" if user.groups else "--clear-groups"
    setpriv = _tool("setpriv")
    return f"{setpriv} --reuid={user.uid} --regid={user.gid} {groups} -- "


def _bind_lines(binds: list[tuple[Path, str, bool]], pod_dir: Path) -> list[str]:
    """The mount commands, in order. A mount whose path holds the pod's directory (the "cover")
    would hide the sources of the binds after it: every other bind is made first, one nested in the
    cover inside the cover's own source directory, and the cover last, recursively (--rbind), so
    that it brings them along."""
    covers = [(source, path) for source, path, _ in binds
              if pod_dir.is_relative_to(path) and _enclosing_bind(path, binds) is None]
    cover = covers[0] if covers else None
    lines: list[str] = []

    def bind(source: Path, at: str, ro: bool, flag: str = "--bind") -> None:
        lines.append(f"mount {flag} {shlex.quote(str(source))} {shlex.quote(at)}")
        if ro:
            lines.append(f"mount -o remount,bind,ro {shlex.quote(at)}")

    for source, target, ro in binds:
        if cover is None or not Path(target).is_relative_to(cover[1]):
            bind(source, target, ro)
        elif target != cover[1]:
            bind(source, str(cover[0] / os.path.relpath(target, cover[1])), ro)
    if cover is not None:
        bind(*next(b for b in binds if b[1] == cover[1]), flag="--rbind")
    return lines


def _code_reachable_lines(user: User | None, pod_dir: Path) -> list[str]:
    """Mount commands that let the pod's user enter every directory on the way to HOST_CODE, as an
    image puts its code where its user reads it: a checkout or an interpreter under /root (0700)
    is not. Each directory the user cannot enter is shown, in the pod's mount namespace only,
    through an overlay whose top grants search (x) to all, not listing; the host's keeps its mode."""
    if user is None:
        return []
    blocked: list[Path] = []
    for code in HOST_CODE:
        for directory in [*reversed(code.parents), code]:
            # (never over the pod's own directory: its volumes' writes would land in the overlay)
            if directory not in blocked and not pod_dir.is_relative_to(directory) \
                    and not _enterable(directory, user):
                blocked.append(directory)
    lines = []
    for index, directory in enumerate(blocked):  # outermost first: a deeper one is seen through it
        base = _overlay_dirs(pod_dir, f"code-{index}")
        upper = base / "upper"
        # The top of an overlay has its upper directory's owner and mode: the lower's, plus search
        # for every class (a user in the directory's group is judged by the group bits, not others').
        info = directory.stat()
        os.chown(upper, info.st_uid, info.st_gid)
        upper.chmod(stat.S_IMODE(info.st_mode) | 0o111)
        options = f"lowerdir={directory},upperdir={upper},workdir={base / 'work'}"
        lines.append(f"mount -t overlay overlay -o {shlex.quote(options)} {shlex.quote(str(directory))}")
    return lines


def _enterable(directory: Path, user: User) -> bool:
    """Whether `user` may search `directory` by its mode bits (owner, else group, else others)."""
    info = directory.stat()
    if info.st_uid == user.uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid == user.gid or info.st_gid in user.groups:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def _host_code_binds(binds: list[tuple[Path, str, bool]]) -> list[tuple[Path, str, bool]]:
    """Read-only binds of the HOST_CODE paths a pod volume would cover, outermost only."""
    covered = [p for p in HOST_CODE if any(p.is_relative_to(target) for _, target, _ in binds)]
    outermost = [p for p in covered if not any(p != q and p.is_relative_to(q) for q in covered)]
    return [(p, str(p), True) for p in outermost]


def _enclosing_bind(target: str, binds: list[tuple[Path, str, bool]]) -> tuple[Path, str] | None:
    """The bind (source, path) whose path strictly contains `target`, innermost first."""
    best: tuple[Path, str] | None = None
    for source, path, _ in binds:
        inside = target != path and Path(target).is_relative_to(path)
        if inside and (best is None or len(path) > len(best[1])):
            best = (source, path)
    return best


def _make_point(path: Path, source: Path) -> None:
    if source.is_dir():
        path.mkdir(parents=True, exist_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def _existing_ancestor(target: str) -> Path:
    for parent in Path(target).parents:
        if parent.exists():
            resolved = parent.resolve()
            if resolved == Path("/"):
                raise Unsupported(f"mount point {target}: a new directory directly under / is not supported")
            return resolved
    raise Unsupported(f"mount point {target}: not an absolute path")


def _overlay_dirs(pod_dir: Path, name: int | str) -> Path:
    base = pod_dir / "overlay" / str(name)
    (base / "upper").mkdir(parents=True, exist_ok=True)
    (base / "work").mkdir(parents=True, exist_ok=True)
    return base


def read_only_volumes(pod: dict[str, object]) -> set[str]:
    spec = pod["spec"]
    assert isinstance(spec, dict)
    return {v["name"] for v in spec.get("volumes") or []
            if any(k in v for k in READ_ONLY_KINDS) or (v.get("persistentVolumeClaim") or {}).get("readOnly")}


__all__ = ["Mount", "fqdn", "hosts_file", "prepare", "read_only_volumes", "resolv_conf"]
