#!/usr/bin/env bash
# Run one llmq worker in a network namespace of its own on this machine, as if on another host:
# its only way out is a veth pair carrying a loopback-range /30 (127.77.0.0/16 by default), so it
# reaches Redis over a real TCP path that is not the host's loopback, while touching no network.
#
#   sudo LLMQ_REDIS_URL=redis://127.77.0.1:6379/0 deploy/netns-worker.sh [command ...]
#
# The command defaults to the repo's `python -m workers` (its .venv if present); it runs inside
# the namespace with this script's environment, so every LLMQ_* setting applies as usual.
# Redis must listen on the host-side address, e.g.
#   redis-server --bind 127.0.0.1 127.77.0.1      (start it once the script has made the veth;
#                                                   the worker retries until Redis answers)
#
# Settings (environment):
#   NETNS_TAG        names: namespace llmq-<tag>, veth lqh-<tag> (host) / lqn-<tag> (namespace);
#                    default this script's pid, so concurrent runs do not collide
#   NETNS_HOST_ADDR  host side of the /30 (default 127.77.0.1)
#   NETNS_NS_ADDR    namespace side      (default 127.77.0.2)
#   LLMQ_REDIS_URL   the worker's Redis  (default redis://<NETNS_HOST_ADDR>:6379/0)
#
# Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and `ip` (iproute2). SIGTERM/SIGINT reach the
# worker, which drains; the namespace and the veth pair are removed on any exit.
set -euo pipefail

tag=${NETNS_TAG:-$$}
ns=llmq-$tag host_if=lqh-$tag ns_if=lqn-$tag
host_addr=${NETNS_HOST_ADDR:-127.77.0.1}
ns_addr=${NETNS_NS_ADDR:-127.77.0.2}
export LLMQ_REDIS_URL=${LLMQ_REDIS_URL:-redis://$host_addr:6379/0}
if (( ${#host_if} > 15 )); then  # the kernel's limit for interface names (IFNAMSIZ - 1)
    echo "netns-worker: NETNS_TAG '$tag' is too long for interface names (max 11 characters)" >&2
    exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=python
[[ -x $repo/.venv/bin/python ]] && python=$repo/.venv/bin/python
(( $# )) || set -- "$python" -m workers

child=
cleanup() {
    trap - EXIT INT TERM
    if [[ -n $child ]] && kill -0 "$child" 2>/dev/null; then
        kill -TERM "$child" 2>/dev/null || true
        wait "$child" 2>/dev/null || true
    fi
    # A namespace outlives its name while a process is still in it: end any such stragglers.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip link del "$host_if" 2>/dev/null || true  # also removes the peer inside the namespace
    ip netns del "$ns" 2>/dev/null || true
}
trap cleanup EXIT
# On a signal: let the worker drain (it exits by itself), then clean up through the EXIT trap.
trap 'kill -TERM "$child" 2>/dev/null || true' INT TERM

ip netns add "$ns"
ip link add "$host_if" type veth peer name "$ns_if"
ip link set "$ns_if" netns "$ns"
ip addr add "$host_addr/30" dev "$host_if"
# 127/8 addresses are "martian" off the lo interface unless route_localnet allows them.
sysctl -qw "net.ipv4.conf.$host_if.route_localnet=1"
ip link set "$host_if" up
ip netns exec "$ns" ip link set lo up  # the engine may talk to itself over loopback
ip netns exec "$ns" ip addr add "$ns_addr/30" dev "$ns_if"
ip netns exec "$ns" sysctl -qw net.ipv4.conf.all.route_localnet=1 "net.ipv4.conf.$ns_if.route_localnet=1"
ip netns exec "$ns" ip link set "$ns_if" up
echo "netns-worker: namespace $ns, veth $host_if ($host_addr) <-> $ns_if ($ns_addr), redis $LLMQ_REDIS_URL" >&2

cd "$repo"
ip netns exec "$ns" "$@" &
child=$!
# `wait` returns early when a trapped signal arrives; keep waiting until the worker has exited.
status=0
wait "$child" || status=$?
while kill -0 "$child" 2>/dev/null; do
    wait "$child" && status=0 || status=$?
done
exit "$status"
