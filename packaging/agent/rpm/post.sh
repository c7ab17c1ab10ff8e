# nightshift-agent %post: the state directory; systemd learns of the unit (not enabled: edit
# /etc/nightshift/agent.toml, then systemctl enable --now nightshift-agent).
install -d -o root -g nightshift -m 0750 /var/lib/nightshift
install -d -o nightshift -g nightshift -m 0750 /var/lib/nightshift/agent
if [ -d /run/systemd/system ]; then systemctl daemon-reload >/dev/null 2>&1 || :; fi
exit 0
