# nightshift-coordinator %pre: the nightshift user.
getent group nightshift >/dev/null || groupadd --system nightshift
getent passwd nightshift >/dev/null || useradd --system --gid nightshift --no-create-home \
    --home-dir /var/lib/nightshift --shell /sbin/nologin --comment "nightshift services" nightshift
exit 0
