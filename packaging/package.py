#!/usr/bin/env python3
"""Makes one crate's .deb (with dpkg-deb) and .rpm (with rpmbuild) from its Cargo.toml's
[package.metadata.deb] and [package.metadata.generate-rpm] tables, the keys cargo-deb and
cargo-generate-rpm read, so that packaging/build.sh needs neither tool compiled from source.

Usage: package.py OUT_DIR CRATE_DIR...   (run from the workspace root, after the release
build: an asset `target/release/NAME` is the workspace's release binary, or NAME in the
directory $NIGHTSHIFT_PACKAGE_BINARIES where that is set).

Only what nightshift's crates use is supported; any other key is refused, naming it, rather
than left out of a package.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

ROOT = Path.cwd()
ARCH_DEB = "amd64"
ARCH_RPM = "x86_64"
DEB_KEYS = {
    "name", "maintainer", "section", "priority", "depends", "recommends",
    "extended-description", "maintainer-scripts", "systemd-units", "assets",
}
RPM_KEYS = {
    "name", "summary", "assets", "pre_install_script", "post_install_script",
    "pre_uninstall_script", "post_uninstall_script",
}
RPM_ASSET_KEYS = {"source", "dest", "mode", "config", "doc"}


class BadMetadata(Exception):
    pass


def fail(crate, msg):
    raise BadMetadata(f"{crate}/Cargo.toml: {msg}")


def load(crate):
    """The crate's package table, with workspace-inherited keys resolved."""
    with open(ROOT / "Cargo.toml", "rb") as f:
        workspace = tomllib.load(f)["workspace"]["package"]
    with open(ROOT / crate / "Cargo.toml", "rb") as f:
        package = tomllib.load(f)["package"]
    for key, value in list(package.items()):
        if isinstance(value, dict) and value.get("workspace") is True:
            if key not in workspace:
                fail(crate, f"package.{key}: inherited from the workspace, which has no {key}")
            package[key] = workspace[key]
    return package


def asset_path(source, base):
    """Where an asset's file is: a built binary, `target/release/NAME`, in the workspace's
    target directory (or NAME in $NIGHTSHIFT_PACKAGE_BINARIES where that is set); anything
    else relative to `base`: the crate for cargo-deb's tables, the workspace for
    cargo-generate-rpm's, as each tool reads them."""
    if source.startswith("target/release/"):
        binaries = os.environ.get("NIGHTSHIFT_PACKAGE_BINARIES")
        if binaries:
            return Path(binaries).resolve() / source.removeprefix("target/release/")
        return ROOT / source
    return (base / source).resolve()


def mode_of(crate, mode):
    try:
        return int(mode, 8)
    except (TypeError, ValueError):
        fail(crate, f"asset mode {mode!r} is not an octal permission")


def wrap_description(text):
    """Description lines of a control file: each at most 79 characters, continuation lines
    indented by one space, an empty line written as ` .`."""
    out = []
    for paragraph in text.split("\n"):
        if not paragraph.strip():
            out.append(" .")
            continue
        for line in textwrap.wrap(paragraph, 79, break_long_words=False, break_on_hyphens=False):
            out.append(" " + line)
    return out


# What cargo-deb adds for a unit that is neither enabled nor started on install
# (`systemd-units = { enable = false, start = false }`), dh_installsystemd's fragments: on
# configure, keep an operator's enablement and restart a running unit after an upgrade; on
# removal, stop it; then mask it (remove) or forget it (purge).
POSTINST_UNIT = """\
# Automatically added by cargo-deb
if [ "$1" = "configure" ] || [ "$1" = "abort-upgrade" ] || [ "$1" = "abort-deconfigure" ] || [ "$1" = "abort-remove" ] ; then
	if deb-systemd-helper debian-installed {unit}; then
		# This will only remove masks created by d-s-h on package removal.
		deb-systemd-helper unmask {unit} >/dev/null || true

		if deb-systemd-helper --quiet was-enabled {unit}; then
			# Create new symlinks, if any.
			deb-systemd-helper enable {unit} >/dev/null || true
		fi
	fi

	# Update the statefile to add new symlinks (if any), which need to be cleaned
	# up on purge. Also remove old symlinks.
	deb-systemd-helper update-state {unit} >/dev/null || true
fi
# End automatically added section
"""
POSTINST_RESTART = """\
# Automatically added by cargo-deb
if [ "$1" = "configure" ] || [ "$1" = "abort-upgrade" ] || [ "$1" = "abort-deconfigure" ] || [ "$1" = "abort-remove" ] ; then
	if [ -d /run/systemd/system ]; then
		systemctl --system daemon-reload >/dev/null || true
		if [ -n "$2" ]; then
			deb-systemd-invoke try-restart {unit} >/dev/null || true
		fi
	fi
fi
# End automatically added section
"""
PRERM_UNIT = """\
# Automatically added by cargo-deb
if [ -d /run/systemd/system ] && [ "$1" = remove ]; then
	deb-systemd-invoke stop {unit} >/dev/null || true
fi
# End automatically added section
"""
POSTRM_UNIT = """\
# Automatically added by cargo-deb
if [ "$1" = "remove" ]; then
	if [ -x "/usr/bin/deb-systemd-helper" ]; then
		deb-systemd-helper mask {unit} >/dev/null || true
	fi
fi

if [ "$1" = "purge" ]; then
	if [ -x "/usr/bin/deb-systemd-helper" ]; then
		deb-systemd-helper purge {unit} >/dev/null || true
		deb-systemd-helper unmask {unit} >/dev/null || true
	fi
fi
# End automatically added section
"""
POSTRM_RELOAD = """\
# Automatically added by cargo-deb
if [ -d /run/systemd/system ]; then
	systemctl --system daemon-reload >/dev/null || true
fi
# End automatically added section
"""


def shlib_depends(binaries):
    """`$auto`: the shared libraries' packages, as dpkg-shlibdeps finds them (libgcc left
    out: it is always there)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "debian").mkdir()
        (Path(tmp) / "debian" / "control").touch()
        out = subprocess.run(
            ["dpkg-shlibdeps", "-xlibgcc", "-O", *map(str, binaries)],
            cwd=tmp, env={**os.environ, "DEB_HOST_ARCH": ARCH_DEB},
            check=True, capture_output=True, text=True,
        ).stdout
    for line in out.splitlines():
        if line.startswith("shlibs:Depends="):
            deps = [d.strip() for d in line.split("=", 1)[1].split(",")]
            return [d for d in deps if d and not d.startswith(("libgcc-", "libgcc1"))]
    raise RuntimeError(f"dpkg-shlibdeps printed no shlibs:Depends for {binaries}")


def build_deb(crate, package, out_dir):
    meta = package.get("metadata", {}).get("deb")
    if meta is None:
        fail(crate, "has no [package.metadata.deb]")
    unknown = set(meta) - DEB_KEYS
    if unknown:
        fail(crate, f"package.metadata.deb: {', '.join(sorted(unknown))} not supported by packaging/package.py")
    name = meta.get("name", package["name"])
    version = f"{package['version']}-1"
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "root"
        control_dir = tree / "DEBIAN"
        control_dir.mkdir(parents=True)
        files = []  # (path in the package, source file, mode)
        for asset in meta.get("assets", []):
            if not (isinstance(asset, list) and len(asset) == 3):
                fail(crate, f"package.metadata.deb.assets: {asset!r} is not [source, dest, mode]")
            source, dest, mode = asset
            src = asset_path(source, ROOT / crate)
            if dest.endswith("/"):
                dest += src.name
            files.append((dest.lstrip("/"), src, mode_of(crate, mode)))
        units = meta.get("systemd-units")
        unit_file = None
        if units is not None:
            unknown = set(units) - {"unit-scripts", "unit-name", "enable", "start"}
            if unknown or units.get("enable") is not False or units.get("start") is not False:
                fail(crate, "package.metadata.deb.systemd-units: only unit-scripts, unit-name and "
                            "enable = false, start = false are supported by packaging/package.py")
            unit_file = f"{units['unit-name']}.service"
            src = (ROOT / crate / units["unit-scripts"] / unit_file).resolve()
            files.append((f"usr/lib/systemd/system/{unit_file}", src, 0o644))
        copyright_text = (
            "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
            f"Upstream-Name: {package['name']}\n"
            f"Comment: Copyright information missing (maintainer: {meta['maintainer']})\n"
            f"License: {package['license']}\n"
        )
        generated = {f"usr/share/doc/{name}/copyright": copyright_text}
        installed_kib = 0
        for dest, src, mode in files:
            if not src.is_file():
                fail(crate, f"asset {src} is missing (run the build first)")
            path = tree / dest
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, path)
            if dest.startswith("usr/bin/"):
                # The .deb's binaries stripped as cargo-deb strips them.
                subprocess.run(["strip", "--strip-unneeded", "--remove-section=.comment",
                                "--remove-section=.note", str(path)], check=True)
            os.chmod(path, mode)
            # About 1 KiB of file system overhead per file, as cargo-deb counts.
            installed_kib += (path.stat().st_size + 2047) // 1024
        for dest, text in generated.items():
            path = tree / dest
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            os.chmod(path, 0o644)
            installed_kib += (len(text.encode()) + 2047) // 1024

        depends = []
        for dep in [d.strip() for d in meta.get("depends", "$auto").split(",")]:
            if dep == "$auto":
                binaries = [tree / dest for dest, _, _ in files if dest.startswith("usr/bin/")]
                depends += shlib_depends(binaries)
            elif dep:
                depends.append(dep)
        control = [
            f"Package: {name}",
            f"Version: {version}",
            f"Architecture: {ARCH_DEB}",
        ]
        if "section" in meta:
            control.append(f"Section: {meta['section']}")
        control.append(f"Priority: {meta.get('priority', 'optional')}")
        control.append(f"Maintainer: {meta['maintainer']}")
        control.append(f"Installed-Size: {installed_kib}")
        control.append(f"Depends: {', '.join(depends)}")
        if meta.get("recommends"):
            control.append(f"Recommends: {meta['recommends'].strip()}")
        control.append(f"Description: {package['description']}")
        if meta.get("extended-description"):
            control += wrap_description(meta["extended-description"])
        # Ended by an empty line, as cargo-deb writes it.
        (control_dir / "control").write_text("\n".join(control) + "\n\n")

        conffiles = sorted("/" + d for d, _, _ in files if d.startswith("etc/"))
        if conffiles:
            (control_dir / "conffiles").write_text("".join(c + "\n" for c in conffiles))

        scripts_dir = meta.get("maintainer-scripts")
        for script in ["preinst", "postinst", "prerm", "postrm"]:
            text = None
            if scripts_dir:
                path = ROOT / crate / scripts_dir / script
                if path.is_file():
                    text = path.read_text()
            fragments = ""
            if unit_file and script == "postinst":
                fragments = POSTINST_UNIT + POSTINST_RESTART
            elif unit_file and script == "prerm":
                fragments = PRERM_UNIT
            elif unit_file and script == "postrm":
                fragments = POSTRM_RELOAD + POSTRM_UNIT
            fragments = fragments.format(unit=unit_file)
            if text is None and not fragments:
                continue
            if text is None:
                text = "#!/bin/sh\nset -e\n#DEBHELPER#"
            if "#DEBHELPER#" not in text:
                fail(crate, f"{scripts_dir}{script} has no #DEBHELPER# line")
            text = text.replace("#DEBHELPER#", fragments)
            out = control_dir / script
            out.write_text(text)
            os.chmod(out, 0o755)

        deb = Path(out_dir) / f"{name}_{version}_{ARCH_DEB}.deb"
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(deb)],
            check=True, stdout=subprocess.DEVNULL,
        )
    return deb


def build_rpm(crate, package, out_dir):
    meta = package.get("metadata", {}).get("generate-rpm")
    if meta is None:
        fail(crate, "has no [package.metadata.generate-rpm]")
    unknown = set(meta) - RPM_KEYS
    if unknown:
        fail(crate, f"package.metadata.generate-rpm: {', '.join(sorted(unknown))} not supported by packaging/package.py")
    name = meta.get("name", package["name"])
    with tempfile.TemporaryDirectory() as tmp:
        top = Path(tmp)
        buildroot = top / "buildroot"
        files = []
        has_config = False
        for asset in meta["assets"]:
            unknown = set(asset) - RPM_ASSET_KEYS
            if unknown:
                fail(crate, f"package.metadata.generate-rpm.assets: {', '.join(sorted(unknown))} not supported")
            src = asset_path(asset["source"], ROOT)
            if not src.is_file():
                fail(crate, f"asset {src} is missing (run the build first)")
            dest = asset["dest"]
            path = buildroot / dest.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, path)
            mode = mode_of(crate, asset["mode"])
            os.chmod(path, mode)
            line = f"%attr({mode:o}, root, root) {dest}"
            if asset.get("config") == "noreplace":
                line = "%config(noreplace) " + line
                has_config = True
            elif asset.get("config"):
                fail(crate, f"asset {dest}: config = {asset['config']!r} not supported (only \"noreplace\")")
            if asset.get("doc"):
                line = "%doc " + line
            files.append(line)
        scripts = []
        for key, section in [("pre_install_script", "%pre"), ("post_install_script", "%post"),
                             ("pre_uninstall_script", "%preun"), ("post_uninstall_script", "%postun")]:
            if key in meta:
                body = (ROOT / meta[key]).read_text()
                scripts.append(f"{section}\n{body}")
        spec = "\n".join([
            f"Name: {name}",
            f"Version: {package['version']}",
            "Release: 1",
            f"Summary: {meta['summary']}",
            f"License: {package['license']}",
            "Requires: /bin/sh",
            *([f"Provides: config({name}) = {package['version']}-1"] if has_config else []),
            "AutoProv: no",
            "",
            "%description",
            meta["summary"],
            "",
            *scripts,
            "%files",
            *files,
            "",
        ])
        (top / "package.spec").write_text(spec)
        subprocess.run(
            ["rpmbuild", "-bb", "--quiet",
             "--define", f"_topdir {top}",
             "--define", f"_rpmdir {Path(out_dir).resolve()}",
             "--define", "_build_name_fmt %%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm",
             "--define", "__spec_install_post %{nil}",
             "--define", "debug_package %{nil}",
             "--define", "_build_id_links none",
             "--define", "_binary_payload w3.zstdio",
             "--buildroot", str(buildroot),
             "--target", ARCH_RPM,
             str(top / "package.spec")],
            check=True, stdout=subprocess.DEVNULL,
        )
    return Path(out_dir) / f"{name}-{package['version']}-1.{ARCH_RPM}.rpm"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    try:
        for crate in sys.argv[2:]:
            package = load(crate)
            for made in [build_deb(crate, package, out_dir), build_rpm(crate, package, out_dir)]:
                print(made)
    except BadMetadata as e:
        sys.exit(f"packaging/package.py: {e}")


if __name__ == "__main__":
    main()
