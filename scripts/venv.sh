# Sourced by the check scripts: pinned Python tools in a venv under target/, reinstalled only when the pins change.
# pinned_venv DIR "REQ==V ..." NAME: creates DIR with exactly those requirements unless DIR/.installed already
# names them (NAME prefixes the message).
pinned_venv() {
  local venv=$1 reqs=$2 name=$3
  local stamp="$venv/.installed"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$reqs" ]; then
    echo "$name: installing $reqs into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $reqs
    echo "$reqs" > "$stamp"
  fi
}
