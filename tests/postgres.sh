#!/usr/bin/env bash
# A throwaway PostgreSQL for the tests (Debian's `postgresql` package; tests/run.sh installs it
# when missing). `tests/postgres.sh start DIR` makes a cluster in DIR (which must not exist),
# starts it listening on a free port of 127.0.0.1 only, with TLS from a CA of its own, and
# prints the variables the tests read, ready for `eval`:
#   NIGHTSHIFT_TEST_POSTGRES=postgres://postgres@127.0.0.1:PORT   (no database, no options)
#   NIGHTSHIFT_TEST_POSTGRES_CA=DIR/ca.pem                          (signed the server's cert)
# `tests/postgres.sh stop DIR` stops that server and removes DIR.
# `tests/postgres.sh halt DIR` stops the server and keeps DIR; `resume DIR` starts it again on
# the same port (an outage of the database, for the failover tests).
# initdb refuses root: as root, the cluster belongs to the package's `postgres` user.
set -euo pipefail
command="${1:?usage: tests/postgres.sh start|stop DIR}"
dir="${2:?usage: tests/postgres.sh start|stop DIR}"
bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
if [ -z "$bin" ]; then
    echo "tests/postgres.sh: PostgreSQL is not installed (apt-get install postgresql)" >&2
    exit 1
fi
if [ "$(id -u)" = 0 ]; then as_pg=(runuser -u postgres --); else as_pg=(); fi

start_server() {
    "${as_pg[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 -o \
        "-k $dir -p $1 -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200 \
         -c ssl=on -c ssl_cert_file=$dir/server.pem -c ssl_key_file=$dir/server.key" \
        start >/dev/null
}

case "$command" in
halt)
    "${as_pg[@]}" "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null
    ;;
resume)
    dir="$(cd "$dir" && pwd)"
    start_server "$(cat "$dir/port")"
    ;;
start)
    mkdir "$dir"
    dir="$(cd "$dir" && pwd)"
    # TLS: a CA, and a certificate for 127.0.0.1 it signed (rustls refuses a CA certificate
    # as the server's own).
    (
        cd "$dir"
        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
            -subj /CN=nightshift-test-ca -keyout ca.key -out ca.pem 2>/dev/null
        openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
            -subj /CN=127.0.0.1 -keyout server.key -out server.csr 2>/dev/null
        printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' > server.ext
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
            -extfile server.ext -out server.pem 2>/dev/null
        chmod 600 server.key
    )
    [ "$(id -u)" = 0 ] && chown -R postgres:postgres "$dir"
    "${as_pg[@]}" "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync >/dev/null
    # A free port can be taken between the probe and the start: try a few.
    for _ in 1 2 3 4 5; do
        port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
        if start_server "$port"; then
            echo "$port" > "$dir/port"
            echo "NIGHTSHIFT_TEST_POSTGRES=postgres://postgres@127.0.0.1:$port"
            echo "NIGHTSHIFT_TEST_POSTGRES_CA=$dir/ca.pem"
            exit 0
        fi
    done
    echo "tests/postgres.sh: PostgreSQL did not start; its log:" >&2
    cat "$dir/server.log" >&2
    exit 1
    ;;
stop)
    if [ -d "$dir/data" ]; then
        "${as_pg[@]}" "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null || true
    fi
    rm -rf "$dir"
    ;;
*)
    echo "usage: tests/postgres.sh start|stop|halt|resume DIR" >&2
    exit 2
    ;;
esac
