#!/bin/bash
# diffjax on every worker of a TPU slice, from your own machine (docs/multihost.md). Returns as soon as every worker
# has started its process, detached from the ssh session (its own session, stdin closed, output to files), so a
# dropped connection neither stops training nor keeps the command waiting.
#
#   TPU=my-v5e ZONE=us-west4-a scripts/tpu_train.sh
#   TPU=my-v5e ZONE=us-west4-a RUN=/mnt/shared/runs/x CONFIG=configs/paper.py:size=830M,arch=diff scripts/tpu_train.sh
#   DRY_RUN=1 TPU=my-v5e ZONE=us-west4-a scripts/tpu_train.sh   # print the gcloud command instead of running it
#
# Slices (Google's "TPU software versions" page, cloud.google.com/tpu/docs/runtimes; `--version` at creation):
#   v5e  --accelerator-type=v5litepod-16  --version=v2-alpha-tpuv5-lite
#   v5p  --accelerator-type=v5p-32        --version=v2-alpha-tpuv5
#   v6e  --accelerator-type=v6e-16        --version=v2-alpha-tpuv6e
# The script is the same for all three: JAX finds the slice's workers itself (--distributed).
#
# Logs: ~/diffjax-train.log on each worker, and RUN/logs/<hostname>.log when RUN is a path every worker mounts (the
# hostname ends in the worker's index); a gs:// RUN keeps the worker's log only. Running the script again while the
# run is alive starts nothing: each new process finds the run's lock held, says by whom, and exits 2 (see the
# worker logs); once the run has stopped, running it again resumes from the last checkpoint. For a Spot slice
# that starts (and resumes) training by itself whenever it is recreated: scripts/tpu_queued.sh.
set -euo pipefail

: "${TPU:?set TPU to the name of the slice}" "${ZONE:?set ZONE to the zone of the slice}"
CONFIG=${CONFIG:-configs/paper.py:size=1.4B,arch=diff}
RUN=${RUN:-/mnt/shared/runs/diff-1.4b}
DATA=${DATA:-/mnt/shared/shards}
TOKENIZER=${TOKENIZER:-cl100k_base}
CHECKOUT=${CHECKOUT:-diffjax}  # the checkout with its .venv on every worker, relative to the home directory

command=(.venv/bin/diffjax train --config "$CONFIG" --workdir "$RUN" --no-progress --distributed
         --set mesh.data=1 --set mesh.fsdp=-1
         --set data.source=shards --set data.path="$DATA" --set data.tokenizer="$TOKENIZER")
train=$(printf '%q ' "${command[@]}")
# What each worker runs: setsid gives the process a session of its own (no terminal whose hangup could reach it),
# nohup ignores SIGHUP all the same, and with stdin and both outputs on files ssh has nothing left to wait for.
if [[ $RUN == *://* ]]; then  # object storage: nothing to create, no log beside the run
    job="cd $(printf '%q' "$CHECKOUT") && exec setsid nohup $train"
else
    logs=$(printf '%q' "$RUN/logs")
    job="cd $(printf '%q' "$CHECKOUT") && mkdir -p $logs && exec setsid nohup bash -c \
$(printf '%q' "${train}2>&1 | tee -a $logs/\$(hostname).log")"
fi
remote="($job) >> \"\$HOME/diffjax-train.log\" 2>&1 < /dev/null &"
launch=(gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all --command="$remote")

if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${launch[@]}"
    echo
    exit 0
fi
exec "${launch[@]}"
