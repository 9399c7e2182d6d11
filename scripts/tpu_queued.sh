#!/bin/bash
# A Spot TPU slice through a queued resource, from your own machine (docs/multihost.md): the slice's start-up script
# (scripts/tpu_startup.sh) installs diffjax on every worker and starts training detached at every boot, so when a
# preempted slice is recreated the run resumes from its last checkpoint without anyone logging in.
#
#   git archive -o diffjax.tar.gz HEAD && gcloud storage cp diffjax.tar.gz gs://my-bucket/diffjax.tar.gz
#   TPU=my-v5e ZONE=us-west4-a SOURCE=gs://my-bucket/diffjax.tar.gz RUN=gs://my-bucket/runs/diff-1.4b \
#       NFS=10.0.0.2:/shared scripts/tpu_queued.sh
#   DRY_RUN=1 TPU=… scripts/tpu_queued.sh      # print the gcloud commands and the start-up script instead
#
# Slices and their runtimes (Google's "TPU software versions" page, cloud.google.com/tpu/docs/runtimes):
#   ACCELERATOR=v5litepod-16 (v5e)  RUNTIME=v2-alpha-tpuv5-lite
#   ACCELERATOR=v5p-32       (v5p)  RUNTIME=v2-alpha-tpuv5
#   ACCELERATOR=v6e-16       (v6e)  RUNTIME=v2-alpha-tpuv6e
# RUNTIME follows from ACCELERATOR's prefix unless set.
#
# Run it again to recreate the slice: a queued resource whose Spot slice was preempted is left SUSPENDED (its nodes
# deleted), and one that could not be provisioned FAILED; either is deleted and created anew. Any other state (waiting,
# provisioning, active) is left alone. To keep a slice coming back, run it every few minutes (cron, a loop).
# The run directory and the data must outlive the slice: RUN on gs:// or on the NFS share, DATA on the share.
set -euo pipefail

: "${TPU:?set TPU to the name of the slice}" "${ZONE:?set ZONE to the zone of the slice}"
: "${SOURCE:?set SOURCE to a gs:// URL of the checkout as a tarball (git archive -o diffjax.tar.gz HEAD)}"
ACCELERATOR=${ACCELERATOR:-v5litepod-16}
case $ACCELERATOR in
    v5litepod-*) default_runtime=v2-alpha-tpuv5-lite ;;
    v5p-*) default_runtime=v2-alpha-tpuv5 ;;
    v6e-*) default_runtime=v2-alpha-tpuv6e ;;
    *) default_runtime="" ;;
esac
RUNTIME=${RUNTIME:-$default_runtime}
: "${RUNTIME:?set RUNTIME to the runtime version of $ACCELERATOR (cloud.google.com/tpu/docs/runtimes)}"
QUEUED=${QUEUED:-$TPU-queued}  # the queued resource's name
RUN=${RUN:-/mnt/shared/runs/diff-1.4b}
DATA=${DATA:-/mnt/shared/shards}
NFS=${NFS:-}
if [[ -z $NFS && ( $RUN != *://* || $DATA != *://* ) ]]; then
    echo "tpu_queued.sh: RUN=$RUN and DATA=$DATA must outlive the slice: set NFS=HOST:/share (mounted at /mnt/shared)" \
         "or put them on gs://" >&2
    exit 2
fi

# the start-up script: the settings, then scripts/tpu_startup.sh after its first line
startup=$(
    echo '#!/bin/bash'
    for name in SOURCE RUN DATA NFS CONFIG TOKENIZER; do
        if [[ -n ${!name:-} ]]; then printf '%s=%q\n' "$name" "${!name}"; fi
    done
    tail -n +2 "$(dirname "$0")/tpu_startup.sh"
)
file=$(mktemp)
trap 'rm -f "$file"' EXIT
printf '%s\n' "$startup" > "$file"

where=(--zone="$ZONE")
create=(gcloud compute tpus queued-resources create "$QUEUED" --node-id="$TPU" "${where[@]}"
        --accelerator-type="$ACCELERATOR" --runtime-version="$RUNTIME" --spot
        --metadata-from-file=startup-script="$file")
delete=(gcloud compute tpus queued-resources delete "$QUEUED" "${where[@]}" --quiet)

if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${delete[@]}"
    echo "  # if it is SUSPENDED or FAILED"
    printf '%q ' "${create[@]}"
    echo
    echo "# startup-script:"
    printf '%s\n' "$startup"
    exit 0
fi
state=$(gcloud compute tpus queued-resources describe "$QUEUED" "${where[@]}" --format='value(state.state)' \
        2>/dev/null || true)
case $state in
    "") ;;
    SUSPENDED | FAILED) "${delete[@]}" ;;
    *) echo "queued resource $QUEUED is $state: left as it is"; exit 0 ;;
esac
"${create[@]}"
