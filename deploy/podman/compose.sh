#!/usr/bin/env bash
# podman-compose for this stack, made to act as Docker Compose does where podman-compose 1.6 does not.
#
#   deploy/podman/compose.sh [podman-compose options] COMMAND [ARGS]    e.g.
#   deploy/podman/compose.sh up -d --scale producer=3     (any podman-compose command; `--in-pod false` is added)
#   deploy/podman/compose.sh health                       (run every container's health check now)
#
# What it adds around podman-compose (deploy/README.md, "Operating the stack under podman-compose"):
# - `up`: producer replicas beyond the number this `up` asks for (--scale producer=N, else LMPIPE_PRODUCERS,
#   else 2) are stopped and removed first, as Docker Compose scales down. podman-compose acts only on the
#   replicas it would create now (<project>_producer_1..N) and creates each with `--requires` on the trainer:
#   when a changed setting recreates the trainer, a replica beyond N keeps the old trainer from being
#   removed ("has dependent containers"); podman-compose carries on, starts the old trainer and exits 0.
# - `down`: every producer replica of the project is removed first (podman-compose would leave those
#   beyond N behind, and with them the trainer they require and the network).
# - `build`, `up --build`: afterwards, the lmpipe images the build replaced (untagged now; label
#   io.lmpipe.image) are deleted. The build cache is kept.
# - `health`: podman runs health checks from systemd timers; without systemd (containers, CI) they never run
#   and `podman ps` says "(starting)" forever. This runs each running container's check once and prints
#   the result (exit 1 if one fails); `podman ps` shows it until the next run.
#
# PODMAN_COMPOSE names the podman-compose to run (default: the first in PATH).
set -euo pipefail

pc=${PODMAN_COMPOSE:-podman-compose}
global=()
while [ $# -gt 0 ]; do
    case $1 in
        -f | --file | -p | --project-name | --in-pod | --pod-args | --env-file | --profile | --podman-path | \
            --parallel | --podman-args | --podman-*-args)
            [ $# -ge 2 ] || { echo "compose.sh: $1 needs a value" >&2; exit 2; }
            global+=("$1" "$2")
            shift 2
            ;;
        -*) global+=("$1"); shift ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || { echo "usage: deploy/podman/compose.sh [podman-compose options] COMMAND [ARGS]" >&2; exit 2; }
case " ${global[*]-} " in
    *" --in-pod "* | *" --in-pod="*) ;;
    *) global=(--in-pod false "${global[@]}") ;; # one network namespace per replica, as with Docker
esac
command=$1
shift

compose() { "$pc" "${global[@]}" "$@"; }

# "name service number" for each container of the project, running or not
containers() {
    compose ps --format '{{.Names}} {{index .Labels "com.docker.compose.service"}} {{index .Labels "com.docker.compose.container-number"}}'
}

# the number of producer replicas this command asks for: --scale producer=N, else the compose file's scale
wanted_producers() {
    local prev="" arg
    for arg in "$@"; do
        case $prev/$arg in
            --scale/producer=*) echo "${arg#producer=}"; return ;;
            */--scale=producer=*) echo "${arg#--scale=producer=}"; return ;;
        esac
        prev=$arg
    done
    # `config` prints the files merged and interpolated: services: producer: ... scale: 'N'
    local config
    config=$(compose config)
    awk '/^  [^ ]/ { in_producer = ($1 == "producer:") }
        in_producer && $1 == "scale:" && !found { gsub(/[^0-9]/, "", $2); print $2; found = 1 }' <<<"$config"
}

# stop and remove the producer replicas numbered above $1
remove_producers_above() {
    local keep=$1 name service number doomed=()
    while read -r name service number; do
        if [ "$service" = producer ] && [ "${number:-0}" -gt "$keep" ]; then
            doomed+=("$name")
        fi
    done < <(containers)
    [ ${#doomed[@]} -gt 0 ] || return 0
    echo "compose.sh: removing producer replicas beyond $keep: ${doomed[*]}" >&2
    podman stop -t 10 "${doomed[@]}" >/dev/null # SIGTERM: each says bye, its shards go to the others
    podman rm "${doomed[@]}" >/dev/null
}

prune_replaced_images() {
    podman image prune -f --filter label=io.lmpipe.image >/dev/null
}

case $command in
    up)
        keep=$(wanted_producers "$@")
        [[ $keep =~ ^[0-9]+$ ]] || { echo "compose.sh: cannot tell how many producers this up wants" >&2; exit 2; }
        remove_producers_above "$keep"
        compose up "$@"
        case " $* " in *" --build "*) prune_replaced_images ;; esac
        ;;
    down)
        remove_producers_above 0
        compose down "$@"
        ;;
    build)
        compose build "$@"
        prune_replaced_images
        ;;
    health)
        status=0
        while read -r name _; do
            if [ "$(podman inspect -f '{{.State.Running}}' "$name" </dev/null)" != true ]; then
                echo "$name: not running"
            elif podman healthcheck run "$name" </dev/null >/dev/null 2>&1; then
                echo "$name: healthy"
            else
                echo "$name: unhealthy"
                status=1
            fi
        done < <(containers)
        exit $status
        ;;
    *) compose "$command" "$@" ;;
esac
