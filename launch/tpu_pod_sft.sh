#!/usr/bin/env bash
# SFT of Qwen2.5-VL-7B on a TPU pod slice (example: v5p-64, 8 hosts x 4 chips = 32 devices).
# Every host runs the same command; `--tpu_pod` makes jax.distributed discover the others.
# Checkpoints, data and the workdir live on a filesystem every host mounts at the same path
# (gcsfuse or Filestore/NFS); the loaders read POSIX paths.
#
#   TPU=my-v5p-64 ZONE=us-east5-a SHARED=/mnt/shared ./launch/tpu_pod_sft.sh
set -euo pipefail
: "${TPU:?name of the TPU VM}" "${ZONE:?zone}" "${SHARED:?path mounted on every host}"
BUCKET=$SHARED

gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command "
  set -e
  cd ~/codedance-jax || git clone https://github.com/codedance-jax/codedance-jax ~/codedance-jax && cd ~/codedance-jax
  python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt 'jax[tpu]==0.10.2'
  .venv/bin/python -m launch.sft --tpu_pod \
    --config=configs/sft.py:qwen25vl_7b \
    --workdir=$BUCKET/runs/sft7b \
    --config.init_from=$BUCKET/ckpt/qwen25vl_7b_orbax \
    --config.data.jsonl=\"('$BUCKET/data/codedance_sft_34k.jsonl',)\" \
    --config.data.tfds_dir=$BUCKET/tfds \
    --config.mesh.data=1 --config.mesh.fsdp=32 --config.mesh.tensor=1 \
    --config.peak_tflops_per_device=459
"
