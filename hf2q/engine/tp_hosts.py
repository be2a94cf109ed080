"""Where the ranks of a tensor-parallel group spanning several machines live: ``mlx.launch``'s hostfile.

A user who already runs MLX across machines has a hostfile for ``mlx.launch``; the same
file places hf2q's ranks, so nothing new is learnt (``--hosts a,b`` is its short form, as for
``mlx.launch``). Its forms (both accepted):

* a list of hosts: ``[{"ssh": "gpu-a", "ips": ["10.0.0.1"]}, {"ssh": "gpu-b", "ips": ["10.0.0.2"]}]``
* an object ``{"backend": "ring" | "nccl", "envs": ["K=V", …], "hosts": [ … as above … ]}``

Host ``r`` of the list is rank ``r``; rank 0 is the machine that runs ``hf2q serve``. Each
rank is reached at the first of its ``ips`` (its ``ssh`` name when it lists none). Ports
follow ``mlx.launch``'s ring convention from one base port ``P`` (``--tp-port``, default
32323, ``mlx.launch``'s ``--starting-port``): rank ``r``'s ring listener is ``P + r``; NCCL's
rendezvous is rank 0 at ``P``; rank 0's control listener (commands to the followers) is
``P + N``. ``envs`` are set in every rank's environment before ``mx.distributed`` starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import attrs

from hf2q.errors import InputError, UsageError

DEFAULT_PORT = 32323  # mlx.launch --starting-port
SECRET_ENV = "HF2Q_TP_TOKEN"  # the same value on every host: who may join a group


@attrs.frozen
class TPHosts:
    """The parsed hostfile: one address per rank, the backend it names (if any), extra environment."""

    addresses: tuple[str, ...]
    base_port: int = DEFAULT_PORT
    backend: str | None = None
    envs: tuple[tuple[str, str], ...] = ()

    @property
    def size(self) -> int:
        return len(self.addresses)

    def ring(self) -> list[str]:
        """``host:port`` of every rank's ring listener, in rank order."""
        return [f"{a}:{self.base_port + r}" for r, a in enumerate(self.addresses)]

    @property
    def nccl(self) -> tuple[str, int]:
        return self.addresses[0], self.base_port

    @property
    def control(self) -> tuple[str, int]:
        """Rank 0's control listener, which every follower connects to."""
        return self.addresses[0], self.base_port + self.size


def read_hostfile(path: str | Path, base_port: int = DEFAULT_PORT) -> TPHosts:
    """Parse ``mlx.launch``'s hostfile; a missing or malformed file is an ``InputError``."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"--hostfile {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"--hostfile {str(p)!r} is not a JSON hostfile: {e}") from None
    backend, envs, hosts = None, [], data
    if isinstance(data, dict):
        backend, envs, hosts = data.get("backend") or None, data.get("envs", []), data.get("hosts")
    if not isinstance(hosts, list) or len(hosts) < 2:
        raise InputError(f"--hostfile {p.name}: needs a list of at least 2 hosts "
                         f"([{{\"ssh\": NAME, \"ips\": [IP]}}, …], as mlx.launch takes)")
    addresses = []
    for r, h in enumerate(hosts):
        ips = h.get("ips") if isinstance(h, dict) else None
        name = (ips[0] if isinstance(ips, list) and ips else None) or (h.get("ssh") if isinstance(h, dict) else None)
        if not isinstance(name, str) or not name:
            raise InputError(f"--hostfile {p.name}: host {r} has neither \"ips\" nor \"ssh\"")
        addresses.append(name)
    if backend not in (None, "ring", "nccl"):
        raise InputError(f"--hostfile {p.name}: backend {backend!r} is not one hf2q runs (ring, nccl)")
    pairs = []
    for e in envs if isinstance(envs, list) else [envs]:
        if not isinstance(e, str) or "=" not in e:
            raise InputError(f"--hostfile {p.name}: envs entry {e!r} is not KEY=VALUE")
        k, v = e.split("=", 1)
        pairs.append((k, v))
    _check_ports(base_port, len(addresses))
    return TPHosts(tuple(addresses), base_port, backend, tuple(pairs))


def hosts_from_list(text: str, base_port: int = DEFAULT_PORT) -> TPHosts:
    """``--hosts a,b,…`` (``mlx.launch``'s short form): host r is rank r, reached at that name or IP."""
    names = [h.strip() for h in text.split(",")]
    if len(names) < 2 or not all(names):
        raise InputError(f"--hosts {text!r}: needs at least 2 comma-separated host names or IPs")
    _check_ports(base_port, len(names))
    return TPHosts(tuple(names), base_port)


def _check_ports(base_port: int, n_hosts: int) -> None:
    """The ring's P+rank and rank 0's control port P+N must all be real ports."""
    if not 1 <= base_port <= 65535 - n_hosts:
        raise InputError(f"--tp-port {base_port}: ports {base_port}..{base_port + n_hosts} must lie in 1..65535")


def hosts_from_args(args) -> TPHosts | None:
    """The group's hosts from ``--hostfile`` or ``--hosts`` (None when neither is given: one machine).

    A group across machines listens on a network address, so it needs the shared secret
    (:func:`group_token`) before anything starts."""
    if getattr(args, "hostfile", None):
        hosts = read_hostfile(args.hostfile, args.tp_port)
    elif getattr(args, "hosts", None):
        hosts = hosts_from_list(args.hosts, args.tp_port)
    else:
        return None
    group_token()
    return hosts


def group_token() -> str:
    """``HF2Q_TP_TOKEN``: the secret every rank of a group across machines presents; without it any host
    that reaches rank 0's control port could join the group and be sent the prompts, so it is required."""
    token = os.environ.get(SECRET_ENV, "")
    if not token:
        raise UsageError(f"{SECRET_ENV} is not set: a tensor-parallel group across hosts needs the same secret "
                         f"on every host (e.g. export {SECRET_ENV}=$(openssl rand -hex 16) on each)")
    return token


def group_size(tensor_parallel: int, hosts: TPHosts) -> int:
    """The group size a command line asks for: the hostfile's host count, which ``--tensor-parallel`` may repeat."""
    if tensor_parallel not in (1, hosts.size):
        raise UsageError(f"--tensor-parallel {tensor_parallel} but the hostfile lists {hosts.size} hosts "
                         f"(one rank per host; leave --tensor-parallel out or make them agree)")
    return hosts.size


def apply_envs(hosts: TPHosts) -> None:
    os.environ.update(dict(hosts.envs))


def model_identity(g) -> str:
    """What every rank's copy of the model must agree on (sizes, names, types and shapes of its tensors),
    cheap to compute on a file of any size; a follower whose file differs is refused at start-up."""
    h = hashlib.sha256(f"{g.arch}:{g.file_bytes}".encode())
    for name in sorted(g.tensors):
        t = g.tensors[name]
        h.update(f"|{name}:{t.qtype.name}:{tuple(t.shape)}".encode())
    return h.hexdigest()[:16]
