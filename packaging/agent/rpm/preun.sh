# nightshift-agent %preun: on erase (not upgrade), stop and disable the unit, then stop and
# remove the containers the agent manages (its vLLM replica, its jobs).
if [ "$1" -eq 0 ]; then
    if [ -d /run/systemd/system ]; then
        systemctl --no-reload disable --now nightshift-agent.service >/dev/null 2>&1 || :
    fi
    /usr/libexec/nightshift/remove-agent-containers || :
fi
exit 0
