# nightshift-agent %postun: systemd forgets a removed unit; an upgrade restarts a running one.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -ge 1 ]; then systemctl try-restart nightshift-agent.service >/dev/null 2>&1 || :; fi
fi
exit 0
