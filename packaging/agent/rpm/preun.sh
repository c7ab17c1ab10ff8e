# nightshift-agent %preun: on erase (not upgrade), stop and disable the unit.
if [ "$1" -eq 0 ] && [ -d /run/systemd/system ]; then
    systemctl --no-reload disable --now nightshift-agent.service >/dev/null 2>&1 || :
fi
exit 0
