#!/usr/bin/env bash
# make kind-e2e: build the image, load it into a kind cluster, `helm install` the
# chart, and run the client checks chart-run runs (openai client through each
# region's proxy, streaming and not; a drain and undrain with the rendered admin
# credential). Needs a Docker engine, kind and kubectl; without a Docker engine it
# says so and exits 0. The cluster is deleted at the end unless KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
HELM=${HELM:-helm}
PY=${PY:-.venv/bin/python}
CLUSTER=${KIND_CLUSTER:-ponto-e2e}
IMAGE=ponto:kind-e2e
NS=ponto

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
    echo "kind-e2e: skipped: no Docker engine answers here (docker info failed)."
    echo "kind-e2e: on a machine with Docker, kind and kubectl, run: make kind-e2e"
    exit 0
fi
for tool in kind kubectl; do
    command -v "$tool" >/dev/null 2>&1 || { echo "kind-e2e: needs $tool on PATH" >&2; exit 1; }
done

step() { echo "--- $*"; }
CREATED=0
cleanup() {
    [[ -n "${PF_PIDS:-}" ]] && kill $PF_PIDS 2>/dev/null || true
    # Only a cluster this run created is deleted.
    if [[ "$CREATED" == 1 && "${KEEP:-0}" != 1 ]]; then
        kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

step "build $IMAGE"
docker build --build-arg BUILD_COMMIT="$(git rev-parse HEAD 2>/dev/null)" -t "$IMAGE" .
step "kind cluster $CLUSTER"
if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    kind create cluster --name "$CLUSTER" --wait 120s
    CREATED=1
fi
# Every kubectl and helm call names the context: the user's current one is left alone.
kubectl() { command kubectl --context "kind-$CLUSTER" "$@"; }
HELM_CTX=(--kube-context "kind-$CLUSTER")
kind load docker-image "$IMAGE" --name "$CLUSTER"

step "simulated origins (the origins a user already runs)"
for region in us-east eu-west; do
    kubectl create namespace "$region" --dry-run=client -o yaml | kubectl apply -f -
    kubectl -n "$region" apply -f - <<YAML
apiVersion: apps/v1
kind: Deployment
metadata: {name: vllm}
spec:
  selector: {matchLabels: {app: vllm}}
  template:
    metadata: {labels: {app: vllm}}
    spec:
      containers:
        - name: sim
          image: $IMAGE
          imagePullPolicy: Never
          command: [ponto-origin-sim]
          args: [--listen=0.0.0.0:8000, --region=$region, --models=llama-3-8b, --ttft-ms=5]
          readinessProbe: {tcpSocket: {port: 8000}, periodSeconds: 2}
---
apiVersion: v1
kind: Service
metadata: {name: vllm}
spec:
  selector: {app: vllm}
  ports: [{port: 8000, targetPort: 8000}]
YAML
    kubectl -n "$region" rollout status deploy/vllm --timeout=120s
done

step "helm install"
"$HELM" "${HELM_CTX[@]}" upgrade --install ponto charts/ponto -n "$NS" --create-namespace \
    -f charts/ponto/ci/kind-values.yaml --wait --timeout 5m
# helm --wait returns once the post-install hook Job has succeeded (it fails the
# install otherwise), so the topology is applied here.

step "API key"
PONTOCTL=(kubectl -n "$NS" exec deploy/ponto-control -- pontoctl --control-plane localhost:7000
    --admin-token-file /etc/ponto/tokens/admin-token
    --tls-ca /etc/ponto/tls/ca.crt --tls-cert /etc/ponto/tls/tls.crt --tls-key /etc/ponto/tls/tls.key)
if ! out=$("${PONTOCTL[@]}" tenant add kind-e2e 2>&1) && [[ "$out" != *"already exists"* ]]; then
    echo "$out" >&2
    exit 1
fi
KEY=$("${PONTOCTL[@]}" key create --tenant kind-e2e | tail -n 1)

step "openai client through each region's Service"
PF_PIDS=""
port=18080
for region in us-east eu-west; do
    kubectl -n "$NS" port-forward "svc/ponto-proxy-$region" "$port:80" >/dev/null &
    PF_PIDS="$PF_PIDS $!"
    eval "PORT_${region//-/_}=$port"
    port=$((port + 1))
done
KEY="$KEY" PORT_US="$PORT_us_east" PORT_EU="$PORT_eu_west" "$PY" - <<'PYCODE'
import os, time
import openai

def chat(port: int, stream: bool) -> tuple[str, str]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=os.environ["KEY"])
    msgs = [{"role": "user", "content": "hello"}]
    if stream:
        raw = client.chat.completions.with_raw_response.create(
            model="llama-3-8b", messages=msgs, stream=True, max_tokens=8)
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        raw = client.chat.completions.with_raw_response.create(
            model="llama-3-8b", messages=msgs, max_tokens=8)
        text = raw.parse().choices[0].message.content or ""
    assert text, "empty answer"
    return text, raw.headers.get("x-ponto-region", "")

deadline = time.monotonic() + 60
while True:  # the key reaches every proxy within seconds
    try:
        chat(int(os.environ["PORT_US"]), False)
        chat(int(os.environ["PORT_EU"]), False)
        break
    except (openai.AuthenticationError, openai.APIConnectionError):
        # The key reaches every proxy within seconds; port-forwards start too.
        if time.monotonic() > deadline:
            raise
        time.sleep(1)
for name, port in (("us-east", os.environ["PORT_US"]), ("eu-west", os.environ["PORT_EU"])):
    for stream in (False, True):
        _, origin = chat(int(port), stream)
        print(f"ok {name} stream={stream} -> {origin}")
PYCODE

# Calls us-east's proxy until its answers come from EXPECT's origins (30 s at most).
served_from() {
    KEY="$KEY" PORT_US="$PORT_us_east" EXPECT="$1" "$PY" - <<'PYCODE'
import os, time
import openai
client = openai.OpenAI(base_url=f"http://127.0.0.1:{os.environ['PORT_US']}/v1", api_key=os.environ["KEY"])
expect = os.environ["EXPECT"]
deadline = time.monotonic() + 30
while True:
    raw = client.chat.completions.with_raw_response.create(
        model="llama-3-8b", messages=[{"role": "user", "content": "where?"}], max_tokens=4)
    if raw.headers.get("x-ponto-region") == expect:
        print(f"ok us-east's proxy is served from {expect}")
        break
    assert time.monotonic() < deadline, f"us-east's proxy is not served from {expect}"
    time.sleep(0.5)
PYCODE
}

step "drain and undrain us-east"
"${PONTOCTL[@]}" drain region us-east
served_from eu-west
"${PONTOCTL[@]}" undrain region us-east
served_from us-east
echo "kind-e2e passed"
