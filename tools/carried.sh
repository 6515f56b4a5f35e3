# shellcheck shell=bash
# Sourced by the scripts that run, on a GPU machine, the builds tools/pending_builds.sh
# carried there (tools/pending_check.sh, tools/pending_ab.sh): each build's compressed
# binary unpacked, and NCCL found for them.

# carried_unpack PACKED DEST: PACKED (NAME.xz) unpacked into DEST, executable; a missing
# file is named.
carried_unpack() {
  [[ -f $1 ]] || { echo "$(basename "$0"): no $1" >&2; return 2; }
  mkdir -p "$(dirname "$2")" && xz -dc "$1" >"$2" && chmod +x "$2"
}

# carried_find_nccl BINARY: the builds link NCCL; where the loader does not find
# libnccl.so.2 for BINARY, the copy that a Python environment's nvidia-nccl package holds
# (torch's) goes on LD_LIBRARY_PATH, if there is one.
carried_find_nccl() {
  ldd "$1" 2>/dev/null | grep -q 'libnccl.so.2 => not found' || return 0
  local nccl
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
  [[ -n $nccl ]] && export LD_LIBRARY_PATH=$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  return 0
}
