#!/usr/bin/env python3
"""Writes helm/pagoda/values.schema.json (checked in; scripts/check-helm.sh fails when it is stale).

The schema is built here rather than by hand so that the shared shapes (resources, scheduling, persistence, PDBs)
stay one definition each. Usage: python3 scripts/helm/gen_schema.py [--check]
"""
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "helm/pagoda/values.schema.json"

# Policies of `pagoda worker --kv-policy` (worker/src/policy/spec.rs PolicyKind::ALL). The CLI-drift check runs
# each rendered --kv-policy through the binary too, so a name the binary lacks fails there.
POLICIES = ["full", "streaming", "knorm", "keydiff", "paged_eviction", "sage", "snapkv", "h2o", "kv_compress"]


def obj(props, required=(), **extra):
    o = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        o["required"] = list(required)
    o.update(extra)
    return o


def integer(minimum=None, maximum=None, **extra):
    o = {"type": "integer"}
    if minimum is not None:
        o["minimum"] = minimum
    if maximum is not None:
        o["maximum"] = maximum
    o.update(extra)
    return o


STR = {"type": "string"}
BOOL = {"type": "boolean"}
PORT = integer(1, 65535)
FREE_MAP = {"type": "object"}
STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
QUANTITY = {"anyOf": [{"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?$"},
                      {"type": "number", "minimum": 0}]}
STORAGE = {"type": "string", "pattern": r"^[1-9][0-9]*(Mi|Gi|Ti)$"}
RESOURCES = obj({
    "requests": {"type": "object", "additionalProperties": QUANTITY},
    "limits": {"type": "object", "additionalProperties": QUANTITY},
    "claims": {"type": "array"},
})
TOLERATIONS = {"type": "array", "items": {"type": "object"}}
SCHEDULING = {"nodeSelector": STR_MAP, "tolerations": TOLERATIONS, "affinity": FREE_MAP}
PVC = obj({
    "storageClassName": STR,
    "accessModes": {"type": "array", "minItems": 1, "items": {"enum": ["ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany", "ReadWriteMany"]}},
    "size": STORAGE,
}, required=["accessModes", "size"])
EXTRA_ARGS = {"type": "array", "items": {"type": "string", "pattern": "^--"}}
RAFT_SIZE = {"enum": [1, 3, 5], "description": "Odd member counts only: 1, 3 or 5."}
# Kubernetes DNS-1123 label (the chart appends suffixes, so keep room).
NAME = {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$", "maxLength": 40}

schema = obj({
    "fullnameOverride": NAME,
    "image": obj({
        "repository": {"type": "string", "minLength": 1},
        "tag": STR,
        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    }, required=["repository", "pullPolicy"]),
    "imagePullSecrets": {"type": "array", "items": obj({"name": {"type": "string", "minLength": 1}}, required=["name"])},
    "model": obj({
        "file": {"type": "string", "pattern": r"^[^/]+\.gguf$"},
        "mountPath": {"type": "string", "pattern": "^/"},
        "id": STR,
        "source": {"enum": ["fetch", "pvc"]},
        "fetch": obj({
            "command": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            "sizeLimit": STORAGE,
            "resources": RESOURCES,
        }),
        "pvc": obj({"claimName": STR, "subPath": STR}),
    }, required=["file", "mountPath", "source"],
        allOf=[{"if": {"properties": {"source": {"const": "pvc"}}},
                "then": {"properties": {"pvc": {"properties": {"claimName": {"minLength": 1}}, "required": ["claimName"]}},
                         "required": ["pvc"]}}]),
    "auth": obj({
        "enabled": BOOL, "existingSecret": STR, "apiKeys": STR, "admin": BOOL, "adminKey": STR,
    }, allOf=[{"if": {"properties": {"enabled": {"const": True}, "existingSecret": {"maxLength": 0}}},
               "then": {"properties": {"apiKeys": {"minLength": 1}}, "required": ["apiKeys"]}},
              {"if": {"properties": {"enabled": {"const": True}, "existingSecret": {"maxLength": 0},
                                     "admin": {"const": True}}},
               # The router's own minimum key length.
               "then": {"properties": {"adminKey": {"minLength": 16}}, "required": ["adminKey"]}}]),
    "tls": obj({"enabled": BOOL, "secretName": STR, "mountPath": {"type": "string", "pattern": "^/[^,]*$"}},
               allOf=[{"if": {"properties": {"enabled": {"const": True}}},
                       "then": {"properties": {"secretName": {"minLength": 1}}, "required": ["secretName"]}}]),
    "podSecurityContext": FREE_MAP,
    "securityContext": FREE_MAP,
    "router": obj({
        "replicas": integer(1),
        "port": PORT,
        # `pagoda router --body-limit` (1 KiB to 1 GiB; 0: the binary's default).
        "bodyLimit": {"anyOf": [{"const": 0}, integer(1024, 1 << 30)]},
        # `pagoda router --client-timeout-secs` (1 to 3600; 0: the binary's default).
        "clientTimeoutSecs": integer(0, 3600),
        # `pagoda router --remote-prefill-min-tokens` (0: no remote prefill).
        "remotePrefillMinTokens": integer(0, 1 << 24),
        "extraArgs": EXTRA_ARGS,
        "resources": RESOURCES,
        "autoscaling": obj({
            "enabled": BOOL,
            "minReplicas": integer(1),
            "maxReplicas": integer(1),
            "targetCPUUtilizationPercentage": integer(1, 100),
        }),
        "service": obj({
            "type": {"enum": ["ClusterIP", "LoadBalancer", "NodePort"]},
            "port": PORT,
            "annotations": STR_MAP,
            "loadBalancerSourceRanges": {"type": "array", "items": {"type": "string", "pattern": r"^[0-9a-fA-F:.]+/[0-9]+$"}},
        }, required=["type", "port"]),
        "ingress": obj({
            "enabled": BOOL,
            "className": STR,
            "annotations": STR_MAP,
            "hosts": {"type": "array", "items": obj({
                "host": STR,
                "paths": {"type": "array", "minItems": 1, "items": obj({
                    "path": {"type": "string", "pattern": "^/"},
                    "pathType": {"enum": ["Prefix", "Exact", "ImplementationSpecific"]},
                }, required=["path", "pathType"])},
            }, required=["paths"])},
            "tls": {"type": "array", "items": obj({
                "hosts": {"type": "array", "items": STR}, "secretName": STR})},
        }, allOf=[{"if": {"properties": {"enabled": {"const": True}}},
                   "then": {"properties": {"hosts": {"minItems": 1}}, "required": ["hosts"]}}]),
        "pdb": obj({"enabled": BOOL, "minAvailable": integer(0)}),
        **SCHEDULING,
    }, required=["port", "service"]),
    "worker": obj({
        "replicas": integer(1, 256),
        "port": PORT,
        # `pagoda worker --role` of these pods; the prefill pods (prefillReplicas) get `prefill`.
        "role": {"enum": ["both", "decode"]},
        "prefillReplicas": integer(0, 256),
        "numBlocks": integer(0),
        "blockSize": {"enum": [8, 16, 32, 64]},
        # The binary's ranges (`pagoda_worker::engine::{MAX_STEP_TOKENS, MAX_RUNNING, MAX_THREADS}`).
        "maxStepTokens": integer(1, 65536),
        "maxRunning": integer(1, 4096),
        "threads": integer(0, 1024),
        # `pagoda worker --device`: cuda runs the GPU runner from the `-cuda` image (Dockerfile.cuda).
        "device": {"enum": ["cpu", "cuda"]},
        "bf16Matmuls": BOOL,
        "speculativeTokens": {"type": "integer", "minimum": 0, "maximum": 16},
        # `pagoda worker --scheduling-policy`.
        "schedulingPolicy": {"enum": ["fcfs", "priority", "fair", "vtc"]},
        "prefixCache": BOOL,
        "kv": obj({
            "policy": {"enum": POLICIES},
            "budgetTokens": {"anyOf": [{"type": "null"}, integer(1)]},
            # `pagoda worker --kv-dtype` (pagoda_kernels::KvDtype).
            "dtype": {"enum": ["f16", "f32", "int8", "fp8_e4m3", "fp8_e4m3_rotated"]},
        }, required=["policy"]),
        "tiers": obj({
            "hostMiB": integer(0),
            "diskMiB": integer(0),
            # `pagoda worker --tier-placement` / `--tier-codec` / `--evicpress-alpha` (worker/src/placement.rs).
            "placement": {"enum": ["lru", "evicpress"]},
            "codec": {"enum": ["native", "bf16", "int8", "fp8_e4m3", "fp8_e4m3_rotated", "int4_kivi", "int2_kivi"]},
            # `--kivi-residual-tokens` (tiers/residual.rs MAX_RESIDUAL_TOKENS).
            "kiviResidualTokens": integer(0, 4096),
            # `--kivi-int8-layers` (tiers/codec.rs Int8Layers: layers of a model of at most 64).
            # `--kivi-int8-layers`: at most Int8Layers::MAX_LISTED (tiers/codec.rs), so the stored codec name fits
            # pagoda_proto::MAX_CODEC_NAME_BYTES.
            "kiviInt8Layers": {"type": "array", "maxItems": 15, "uniqueItems": True, "items": integer(0, 63)},
            "evicpressAlpha": {"type": "number", "minimum": 0},
            # `--evicpress-keep-ratios`: comma-separated ratios in (0, 1), or none (tiers/pruned.rs).
            "evicpressKeepRatios": {"type": "string", "pattern": r"^(none|0?\.[0-9]*[1-9][0-9]*(,0?\.[0-9]*[1-9][0-9]*){0,3})$"},
            # `--evicpress-profile` (placement.rs ProfileScoring).
            "evicpressProfile": {"enum": ["forced", "free"]},
            # `--evicpress-horizon` (placement.rs AnswerHorizon).
            "evicpressHorizon": {"enum": ["observed", "fixed"]},
            # `--evicpress-shrink` (placement.rs VariantQuality::shrunk).
            "evicpressShrink": BOOL,
            # `--evicpress-pooled-profiles` (placement.rs EvicPressConfig::pooled).
            "evicpressPooledProfiles": BOOL,
            # `--evicpress-greedy` (evicpress.rs GreedyRule).
            "evicpressGreedy": {"enum": ["drop", "per-byte"]},
            # `--evicpress-upgrade` (placement.rs EvicPressConfig::upgrade).
            "evicpressUpgrade": BOOL,
            # `--evicpress-profile-question`, repeated (placement.rs MAX_PROFILE_QUESTIONS; main.rs byte bound).
            "evicpressProfileQuestions": {
                "type": "array", "maxItems": 8,
                "items": {"type": "string", "minLength": 1, "maxLength": 512, "pattern": r"\S"},
            },
        }, required=["hostMiB", "diskMiB"]),
        # `pagoda worker --lora NAME=/lora/PATH` (model/lora.rs valid_lora_name) and `--max-lora-rank`.
        "lora": obj({
            "adapters": {"type": "array", "maxItems": 64, "items": obj({
                "name": {"type": "string", "pattern": r"^[A-Za-z0-9._:/-]{1,128}$"},
                # Relative to the adapters volume; no segment starts with a dot, so none is `..`.
                "path": {"type": "string", "maxLength": 256,
                         "pattern": r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$"},
            }, required=["name", "path"])},
            # A Kubernetes volume source (persistentVolumeClaim, csi, image, ...).
            "volume": {"type": "object"},
            "maxRank": integer(1, 256),
            # `--lora-dir=/lora` (run-time loading) and `--max-loras` (adapters.rs MAX_LOADED_LORAS).
            "runtimeLoading": BOOL,
            # `--lora-dir=/lora --lora-on-demand` (adapters.rs AdapterRegistry::resolve).
            "onDemand": BOOL,
            "maxLoaded": integer(1, 1024),
        }, allOf=[{"if": {"properties": {flag: {"minItems": 1} if flag == "adapters" else {"const": True}},
                          "required": [flag]},
                   "then": {"properties": {"volume": {"minProperties": 1}}, "required": ["volume"]}}
                  for flag in ("adapters", "runtimeLoading", "onDemand")]),
        "persistence": obj({
            "enabled": BOOL,
            "storageClassName": STR,
            "accessModes": PVC["properties"]["accessModes"],
            "size": STORAGE,
        }),
        "gpu": obj({
            "enabled": BOOL,
            "count": integer(1, 16),
            "resourceName": {"type": "string", "pattern": r"^[a-z0-9.-]+/[a-z0-9.-]+$"},
        }),
        "extraArgs": EXTRA_ARGS,
        "resources": RESOURCES,
        "pdb": obj({"enabled": BOOL, "maxUnavailable": integer(1)}),
        **SCHEDULING,
    }, required=["replicas", "port", "kv", "tiers"],
        # The GPU runner needs a GPU, keeps its KV in f16, has no bf16 CPU matmuls and no EvicPress placement: refused here
        # rather than in a crash loop (the worker refuses the same at start-up).
        allOf=[{"if": {"properties": {"device": {"const": "cuda"}}, "required": ["device"]},
                "then": {"properties": {"gpu": {"properties": {"enabled": {"const": True}}, "required": ["enabled"]},
                                        "bf16Matmuls": {"const": False},
                                        "kv": {"properties": {"dtype": {"const": "f16"}}},
                                        "tiers": {"properties": {"placement": {"const": "lru"}}},
                                        "lora": {"properties": {"adapters": {"maxItems": 0},
                                                                "runtimeLoading": {"const": False},
                                                                "onDemand": {"const": False}}}}}},
               # EvicPress profiles contexts with the base model; the worker refuses adapters beside it.
               {"if": {"properties": {"tiers": {"properties": {"placement": {"const": "evicpress"}},
                                                "required": ["placement"]}}, "required": ["tiers"]},
                "then": {"properties": {"lora": {"properties": {"adapters": {"maxItems": 0},
                                                                 "runtimeLoading": {"const": False},
                                                                 "onDemand": {"const": False}}}}}}]),
    "kvstore": obj({
        "enabled": BOOL,
        "replicas": RAFT_SIZE,
        "port": PORT,
        "persistence": PVC,
        "extraArgs": EXTRA_ARGS,
        "resources": RESOURCES,
        "pdb": obj({"enabled": BOOL}),
        **SCHEDULING,
    }, required=["replicas", "port"]),
    "etcd": obj({
        "mode": {"enum": ["bundled", "external"]},
        "external": obj({"endpoints": {"type": "array", "items": {"type": "string", "pattern": r"^https?://[^/\s]+$"}}}),
        "image": obj({"repository": {"type": "string", "minLength": 1}, "tag": {"type": "string", "minLength": 1},
                      "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}),
        "replicas": RAFT_SIZE,
        "clientPort": PORT,
        "peerPort": PORT,
        "persistence": PVC,
        "resources": RESOURCES,
        "pdb": obj({"enabled": BOOL}),
        **SCHEDULING,
    }, required=["mode"], allOf=[{"if": {"properties": {"mode": {"const": "external"}}},
                                  "then": {"properties": {"external": {"properties": {"endpoints": {"minItems": 1}},
                                                                       "required": ["endpoints"]}},
                                           "required": ["external"]}}]),
    "networkPolicy": obj({"enabled": BOOL, "routerFrom": {"type": "array", "items": {"type": "object"}}}),
    "metrics": obj({
        "serviceMonitor": obj({
            "enabled": BOOL,
            "interval": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
            "scrapeTimeout": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
            "labels": STR_MAP,
        }),
        "dashboard": obj({"enabled": BOOL, "labels": STR_MAP, "annotations": STR_MAP}),
    }),
}, required=["image", "model", "router", "worker", "kvstore", "etcd"])
schema["$schema"] = "http://json-schema.org/draft-07/schema#"
schema["title"] = "Values of the Pagoda Helm chart"

text = json.dumps(schema, indent=2) + "\n"
if "--check" in sys.argv[1:]:
    if not OUT.exists() or OUT.read_text() != text:
        sys.exit(f"{OUT} is stale: run python3 scripts/helm/gen_schema.py")
else:
    OUT.write_text(text)
