#!/usr/bin/env bash
# End to end on a real cluster: kind (created if missing) or an existing k3s / any kubectl context.
# Nothing here has run on these development machines (no container runtime, no cluster): run it where
# docker + kind (or k3s) exist. See docs/kubernetes.md.
#
#   deploy/e2e-kind.sh                 # kind cluster "ember-e2e", the packaged fleet
#   CLUSTER=k3s deploy/e2e-kind.sh     # the current kubectl context (k3s), image imported with k3s ctr
#
# Checks: the rendered manifests apply; the gateway serves a chat completion through a replica it
# discovered; scaling the Deployment 2 -> 3 -> 1 is followed by the gateway's routing; a request in
# flight on a deleted pod finishes (drain, not cut).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-ember-e2e}
IMAGE=${IMAGE:-ember:0.1.0-cpu}
NS=ember
REPLICAS=deploy/ember-smollm2-135m-instruct-stable
KEY=sk-ember-local  # the packaged fleet's development key
OUT=$(mktemp -d)
PYTHON=${PYTHON:-python3}

docker build -f deploy/Dockerfile -t "$IMAGE" .
if [ "$CLUSTER" = k3s ]; then
  docker save "$IMAGE" | sudo k3s ctr images import -
else
  kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER"
  kind load docker-image "$IMAGE" --name "$CLUSTER"
  kubectl config use-context "kind-$CLUSTER"
fi

"$PYTHON" -m ember.cli deploy k8s -o "$OUT"
kubectl get crd servicemonitors.monitoring.coreos.com >/dev/null 2>&1 || rm "$OUT/30-servicemonitor.yaml"
kubectl apply -f "$OUT"
kubectl -n "$NS" rollout status deploy/ember-gateway "$REPLICAS" --timeout=10m

kubectl -n "$NS" port-forward svc/ember-gateway 18000:8000 >/dev/null &
FORWARD=$!
trap 'kill $FORWARD' EXIT
sleep 3
GATEWAY=http://127.0.0.1:18000

chat() {
  curl -sf "$GATEWAY/v1/chat/completions" -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": '"${1:-8}"'}'
}

routed() {  # how many replicas the gateway routes to
  curl -s "$GATEWAY/ready" | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["healthy_replicas"]["smollm2-135m-instruct"])'
}

wait_routed() {
  for _ in $(seq 120); do [ "$(routed)" = "$1" ] && return 0; sleep 1; done
  echo "FAIL: the gateway routes to $(routed) replicas, expected $1" >&2; exit 1
}

chat | grep -q '"choices"' && echo "ok: a chat completion through the gateway"
wait_routed 2 && echo "ok: 2 replicas discovered"
kubectl -n "$NS" scale "$REPLICAS" --replicas=3 && wait_routed 3 && echo "ok: scaled to 3, routed to 3"

# A long request in flight while its pod is deleted must finish: preStop + the server's drain.
chat 200 > "$OUT/long.json" &
LONG=$!
sleep 1
POD=$(kubectl -n "$NS" get pods -l app.kubernetes.io/instance=ember-smollm2-135m-instruct-stable -o name | head -1)
kubectl -n "$NS" delete "$POD" --wait=false
wait $LONG && grep -q '"choices"' "$OUT/long.json" && echo "ok: the request in flight during a pod deletion finished"

kubectl -n "$NS" scale "$REPLICAS" --replicas=1 && wait_routed 1 && echo "ok: scaled to 1, routed to 1"
echo "e2e passed"
