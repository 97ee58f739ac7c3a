#!/usr/bin/env bash
# A throwaway sshd on loopback addresses, for the SSH launcher's tests.
#
#   scripts/sshd.sh start DIR [ADDR...]   start one (default 127.0.0.2 127.0.0.3);
#                                         prints its port
#   scripts/sshd.sh stop DIR              stop it (by the pid in DIR/sshd.pid)
#
# DIR gets a host key, a client key (DIR/client_key), authorized_keys, a config,
# a known_hosts file with the host key for every address (DIR/known_hosts), and
# the log (DIR/sshd.log). Needs Debian's openssh-server.
set -euo pipefail
cmd=${1:?start|stop}; dir=${2:?directory}
case "$cmd" in
start)
  shift 2
  addrs=("$@"); [ ${#addrs[@]} -gt 0 ] || addrs=(127.0.0.2 127.0.0.3)
  sshd_bin=$(command -v sshd || echo /usr/sbin/sshd)
  [ -x "$sshd_bin" ] || { echo "sshd not found (apt-get install openssh-server)" >&2; exit 1; }
  mkdir -p "$dir" /run/sshd
  ssh-keygen -q -t ed25519 -N '' -f "$dir/host_key" <<<y >/dev/null
  ssh-keygen -q -t ed25519 -N '' -f "$dir/client_key" <<<y >/dev/null
  cp "$dir/client_key.pub" "$dir/authorized_keys"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  {
    echo "Port $port"
    for a in "${addrs[@]}"; do echo "ListenAddress $a"; done
    echo "HostKey $dir/host_key"
    echo "PidFile $dir/sshd.pid"
    echo "AuthorizedKeysFile $dir/authorized_keys"
    echo "PermitRootLogin prohibit-password"
    echo "PasswordAuthentication no"
    echo "KbdInteractiveAuthentication no"
    echo "UsePAM no"
    echo "StrictModes no"
    echo "MaxStartups 100"
    echo "MaxSessions 100"
  } > "$dir/sshd_config"
  "$sshd_bin" -t -f "$dir/sshd_config"
  "$sshd_bin" -f "$dir/sshd_config" -E "$dir/sshd.log"
  key=$(cut -d' ' -f1,2 "$dir/host_key.pub")
  : > "$dir/known_hosts"
  for a in "${addrs[@]}"; do echo "[$a]:$port $key" >> "$dir/known_hosts"; done
  for _ in $(seq 50); do [ -s "$dir/sshd.pid" ] && break; sleep 0.1; done
  echo "$port"
  ;;
stop)
  [ -s "$dir/sshd.pid" ] && kill "$(cat "$dir/sshd.pid")" 2>/dev/null || true
  ;;
*) echo "usage: $0 start|stop DIR [ADDR...]" >&2; exit 2 ;;
esac
