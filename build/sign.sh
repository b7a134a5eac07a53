#!/usr/bin/env bash
# Codesign (hardened runtime + secure timestamp), verify and, given credentials, notarize a
# frozen afmd built by build/build.py. macOS only.
#
#   build/sign.sh build/work/dist-onedir/afmd        # onedir: the folder with afmd + _internal
#   build/sign.sh build/work/dist-onefile/afmd       # onefile: the binary
#
# build/build.py --sign runs it between PyInstaller and packaging, so the tarball holds the
# signed files. Environment:
#   AFMD_SIGN_IDENTITY   required: "Developer ID Application: NAME (TEAMID)", or "-" for an
#                        ad-hoc signature (local tests only: no timestamp, no notarization)
#   AFMD_KEYCHAIN        optional keychain holding the identity (CI imports one)
#   Notarization, when one of these sets is complete (else it is skipped, said loudly):
#     AFMD_NOTARY_PROFILE                     a `xcrun notarytool store-credentials` profile
#     AFMD_NOTARY_KEY, AFMD_NOTARY_KEY_ID, AFMD_NOTARY_ISSUER   App Store Connect API key (.p8)
#     AFMD_NOTARY_APPLE_ID, AFMD_NOTARY_TEAM_ID, AFMD_NOTARY_PASSWORD   app-specific password
#
# Exit codes: 0 signed and verified (and notarized when credentials were given), 1 a step
# failed, 2 wrong platform or usage.
#
# A bare command-line binary cannot carry a stapled ticket (stapler handles apps, dmg, pkg);
# Gatekeeper looks the notarization up online. Homebrew downloads with curl, which sets no
# quarantine attribute, so `brew install` never triggers that check anyway.
set -euo pipefail

if [[ "$(uname -s)" != "Darwin" ]]; then
    echo "sign.sh: this script runs on macOS only: codesign, spctl and xcrun notarytool exist" \
         "only there (this is $(uname -s)). Sign in the release workflow" \
         "(.github/workflows/release.yml) or on a Mac." >&2
    exit 2
fi
if [[ $# -ne 1 ]]; then
    echo "usage: build/sign.sh PATH   (a PyInstaller onedir folder or onefile binary)" >&2
    exit 2
fi
if [[ -z "${AFMD_SIGN_IDENTITY:-}" ]]; then
    echo "sign.sh: set AFMD_SIGN_IDENTITY (a Developer ID Application identity, or - for" \
         "ad-hoc); available identities:" >&2
    security find-identity -v -p codesigning >&2 || true
    exit 2
fi

HERE="$(cd "$(dirname "$0")" && pwd)"
ENTITLEMENTS="$HERE/entitlements.plist"
TARGET="${1%/}"
IDENTITY="$AFMD_SIGN_IDENTITY"

if [[ -d "$TARGET" ]]; then
    EXECUTABLE="$TARGET/afmd"
    [[ -d "$TARGET/_internal" ]] || { echo "sign.sh: $TARGET has no _internal folder" >&2; exit 2; }
elif [[ -f "$TARGET" ]]; then
    EXECUTABLE="$TARGET"
else
    echo "sign.sh: $TARGET does not exist" >&2
    exit 2
fi
[[ -f "$EXECUTABLE" ]] || { echo "sign.sh: no executable at $EXECUTABLE" >&2; exit 2; }

SIGN_ARGS=(--force --sign "$IDENTITY")
if [[ "$IDENTITY" == "-" ]]; then
    echo "sign.sh: ad-hoc signature (AFMD_SIGN_IDENTITY=-): fine for local tests, not for release"
    SIGN_ARGS+=(--timestamp=none --options runtime)
else
    SIGN_ARGS+=(--timestamp --options runtime)
fi
if [[ -n "${AFMD_KEYCHAIN:-}" ]]; then
    SIGN_ARGS+=(--keychain "$AFMD_KEYCHAIN")
fi

signed=()

is_macho() { file -b "$1" | grep -q "Mach-O"; }

# 1. Nested code first: every Mach-O file (extensions, dylibs) outside .framework bundles,
#    then each framework version as a bundle (e.g. Python.framework from python.org builds).
if [[ -d "$TARGET" ]]; then
    while IFS= read -r -d '' file; do
        if is_macho "$file"; then
            codesign "${SIGN_ARGS[@]}" "$file"
            signed+=("$file")
        fi
    done < <(find "$TARGET/_internal" -type f -not -path "*.framework/*" -print0)
    while IFS= read -r -d '' version; do
        codesign "${SIGN_ARGS[@]}" "$version"
        signed+=("$version")
    done < <(find "$TARGET/_internal" -type d -path "*.framework/Versions/*" \
                  -not -path "*.framework/Versions/*/*" -print0)
fi

# 2. The executable last, with the hardened-runtime exceptions Python needs.
codesign "${SIGN_ARGS[@]}" --entitlements "$ENTITLEMENTS" "$EXECUTABLE"
signed+=("$EXECUTABLE")
echo "sign.sh: signed ${#signed[@]} items with identity: $IDENTITY"

# 3. Verify every signature strictly, and the flags of the executable.
for item in "${signed[@]}"; do
    codesign --verify --strict --verbose=1 "$item"
done
details="$(codesign --display --verbose=4 "$EXECUTABLE" 2>&1)"
echo "$details" | grep -E "^(Identifier|Authority|Timestamp|CodeDirectory)" || true
echo "$details" | grep -q "(runtime)" || { echo "sign.sh: hardened runtime flag missing" >&2; exit 1; }
codesign --display --entitlements - --xml "$EXECUTABLE" 2>/dev/null \
    | grep -q "allow-unsigned-executable-memory" \
    || { echo "sign.sh: entitlements missing from $EXECUTABLE" >&2; exit 1; }
if [[ "$IDENTITY" != "-" ]]; then
    echo "$details" | grep -q "^Timestamp=" || { echo "sign.sh: no secure timestamp" >&2; exit 1; }
fi

# 4. Notarize when credentials are given.
NOTARY_ARGS=()
if [[ -n "${AFMD_NOTARY_PROFILE:-}" ]]; then
    NOTARY_ARGS=(--keychain-profile "$AFMD_NOTARY_PROFILE")
    [[ -n "${AFMD_KEYCHAIN:-}" ]] && NOTARY_ARGS+=(--keychain "$AFMD_KEYCHAIN")
elif [[ -n "${AFMD_NOTARY_KEY:-}" && -n "${AFMD_NOTARY_KEY_ID:-}" && -n "${AFMD_NOTARY_ISSUER:-}" ]]; then
    NOTARY_ARGS=(--key "$AFMD_NOTARY_KEY" --key-id "$AFMD_NOTARY_KEY_ID" --issuer "$AFMD_NOTARY_ISSUER")
elif [[ -n "${AFMD_NOTARY_APPLE_ID:-}" && -n "${AFMD_NOTARY_TEAM_ID:-}" && -n "${AFMD_NOTARY_PASSWORD:-}" ]]; then
    NOTARY_ARGS=(--apple-id "$AFMD_NOTARY_APPLE_ID" --team-id "$AFMD_NOTARY_TEAM_ID"
                 --password "$AFMD_NOTARY_PASSWORD")
fi

notarized=0
if [[ ${#NOTARY_ARGS[@]} -gt 0 && "$IDENTITY" != "-" ]]; then
    workdir="$(mktemp -d)"
    trap 'rm -rf "$workdir"' EXIT
    archive="$workdir/$(basename "$TARGET").zip"
    ditto -c -k --keepParent "$TARGET" "$archive"
    echo "sign.sh: submitting $archive to the notary service (waits for the verdict)"
    xcrun notarytool submit "$archive" "${NOTARY_ARGS[@]}" --wait --timeout 30m \
        --output-format json > "$workdir/result.json"
    cat "$workdir/result.json"; echo
    status="$(/usr/bin/plutil -extract status raw -o - "$workdir/result.json")"
    if [[ "$status" != "Accepted" ]]; then
        submission="$(/usr/bin/plutil -extract id raw -o - "$workdir/result.json" || true)"
        [[ -n "$submission" ]] && xcrun notarytool log "$submission" "${NOTARY_ARGS[@]}" || true
        echo "sign.sh: notarization ended with status $status" >&2
        exit 1
    fi
    notarized=1
else
    echo "sign.sh: notarization skipped (no AFMD_NOTARY_* credentials, or ad-hoc identity)"
fi

# 5. Gatekeeper's view. `--type execute` only rates app bundles ("does not seem to be an
#    app" for a command-line tool), so ask about the binary's own signature instead.
if [[ "$IDENTITY" != "-" ]]; then
    assessment="$(spctl --assess --type open --context context:primary-signature -vv \
                  "$EXECUTABLE" 2>&1 || true)"
    echo "spctl: $assessment"
    if [[ $notarized -eq 1 ]] && ! grep -q "accepted" <<<"$assessment"; then
        echo "sign.sh: Gatekeeper rejects the notarized binary" >&2
        exit 1
    fi
fi
echo "sign.sh: done ($EXECUTABLE)"
