# nightshift-coordinator %post: the state directory; systemd learns of the unit (not enabled: edit
# /etc/nightshift/coordinator.toml, then systemctl enable --now nightshift-coordinator).
install -d -o root -g nightshift -m 0750 /var/lib/nightshift
install -d -o nightshift -g nightshift -m 0750 /var/lib/nightshift/coordinator
if [ -d /run/systemd/system ]; then systemctl daemon-reload >/dev/null 2>&1 || :; fi
exit 0
