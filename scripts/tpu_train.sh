#!/bin/bash
# diffjax on every worker of a TPU slice, from your own machine (docs/multihost.md): each worker's process runs under
# nohup, so a dropped ssh session does not stop it, and writes its own log beside the run on the shared filesystem.
#
#   TPU=my-v5e ZONE=us-west4-a scripts/tpu_train.sh
#   TPU=my-v5e ZONE=us-west4-a RUN=/mnt/shared/runs/x CONFIG=configs/paper.py:size=830M,arch=diff scripts/tpu_train.sh
#   DRY_RUN=1 TPU=my-v5e ZONE=us-west4-a scripts/tpu_train.sh   # print the gcloud command instead of running it
#
# Running it again resumes from the run's last checkpoint (a run that is still going refuses a second writer).
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
# what each worker runs: detached from the ssh session, stdin closed, one log per worker (its hostname ends in its
# worker index)
remote="cd $(printf '%q' "$CHECKOUT") && mkdir -p $(printf '%q' "$RUN/logs") && \
nohup $(printf '%q ' "${command[@]}")> $(printf '%q' "$RUN/logs")/\$(hostname).log 2>&1 < /dev/null &"
launch=(gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all --command="$remote")

if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${launch[@]}"
    echo
    exit 0
fi
exec "${launch[@]}"
