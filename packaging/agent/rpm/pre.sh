# nightshift-agent %pre: the nightshift user, and the docker group the unit reaches the Docker
# socket through (created as Docker's packages do; see the Debian postinst).
getent group nightshift >/dev/null || groupadd --system nightshift
getent passwd nightshift >/dev/null || useradd --system --gid nightshift --no-create-home \
    --home-dir /var/lib/nightshift --shell /sbin/nologin --comment "nightshift services" nightshift
if ! getent group docker >/dev/null; then
    groupadd --system docker
    echo "nightshift-agent: this host had no docker group; created it (the agent's unit reaches the" >&2
    echo "nightshift-agent: Docker socket through it): restart Docker so its socket joins the group" >&2
fi
exit 0
