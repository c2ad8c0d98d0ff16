#!/usr/bin/env bash
# Tessel across machines, as network namespaces: the coordinator and two
# workers each in a namespace of its own, with its own address on a private
# bridge (in a fourth namespace) over veth pairs. The workers advertise
# their namespace addresses and collectives go over the veth links; taking
# worker 1's link down simulates a partition (tests/deploy/multihost_client.py
# says what is checked). The cluster runs secured: every daemon has a
# certificate for its namespace address from a CA made here, clients present
# a token and workers the join token. Every namespace and address is this
# test's own and is removed at exit.
# Usage: multihost_netns_test.sh BUILD_DIR. Exits 77 (skipped) where
# namespaces cannot be created.
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
id=t$$
hub=$id-hub
net=10.213.$(( $$ % 250 + 1 ))
if ! command -v ip >/dev/null || ! ip netns add "$hub" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here (needs root and iproute2)"
  exit 77
fi
logs=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for n in c w0 w1; do ip netns del "$id-$n" 2>/dev/null || true; done
  ip netns del "$hub" 2>/dev/null || true
  rm -rf "$logs"
}
trap cleanup EXIT
ip -n "$hub" link add br0 type bridge
ip -n "$hub" link set br0 up
n=1
for node in c w0 w1; do
  ns=$id-$node
  ip netns add "$ns"
  ip link add "v$id$node" type veth peer name "h$id$node"
  ip link set "v$id$node" netns "$ns"
  ip link set "h$id$node" netns "$hub"
  ip -n "$hub" link set "h$id$node" master br0 up
  ip -n "$ns" addr add "$net.$n/24" dev "v$id$node"
  ip -n "$ns" link set "v$id$node" up
  ip -n "$ns" link set lo up
  n=$((n + 1))
done
coord=$net.1 w0=$net.2 w1=$net.3
pki=$logs/pki
mkdir -p "$pki"
ssl() { openssl "$@" >/dev/null 2>&1; }
ssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj /CN=tessel-ca \
  -keyout "$pki/ca.key" -out "$pki/ca.pem"
for node in c:$coord w0:$w0 w1:$w1; do
  name=${node%%:*} ip=${node#*:}
  printf 'subjectAltName=IP:%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$ip" >"$pki/$name.ext"
  ssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$name" \
    -keyout "$pki/$name.key" -out "$pki/$name.csr"
  ssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.pem" -CAkey "$pki/ca.key" -CAcreateserial -days 2 \
    -extfile "$pki/$name.ext" -out "$pki/$name.pem"
done
echo "client-token-7d1e ops admin" >"$pki/tokens"
echo "join-token-52aa" >"$pki/join"
tls() { echo "--tls_cert=$pki/$1.pem --tls_key=$pki/$1.key --tls_ca=$pki/ca.pem"; }
# shellcheck disable=SC2046
ip netns exec "$id-c" "$build/bin/tessel-coordinator" --host="$coord" --port=0 --port_file="$logs/port" \
  --heartbeat_timeout_ms=1500 $(tls c) --auth_tokens_file="$pki/tokens" --join_token_file="$pki/join" \
  >"$logs/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -s "$logs/port" ]] && break; sleep 0.1; done
port=$(cat "$logs/port")
# shellcheck disable=SC2046
ip netns exec "$id-w0" "$build/bin/tessel-worker" --coordinator="$coord:$port" --host="$w0" $(tls w0) \
  --join_token_file="$pki/join" >"$logs/w0.log" 2>&1 &
pids+=($!)
# shellcheck disable=SC2046
ip netns exec "$id-w1" "$build/bin/tessel-worker" --coordinator="$coord:$port" --host="$w1" $(tls w1) \
  --join_token_file="$pki/join" >"$logs/w1.log" 2>&1 &
pids+=($!)
status=0
ip netns exec "$id-c" env TESSEL_TOKEN=client-token-7d1e TESSEL_TLS_CA="$pki/ca.pem" PYTHONPATH="$here/../../client/python${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" \
  "$here/multihost_client.py" "$coord:$port" "$w0" "$w1" \
  "ip -n $hub link set h${id}w1 down" "ip -n $hub link set h${id}w1 up" || status=$?
if [[ $status != 0 ]]; then
  for f in coordinator w0 w1; do echo "--- $f.log"; tail -20 "$logs/$f.log"; done
fi
exit $status
