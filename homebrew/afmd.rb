# Homebrew formula for afmd: the prebuilt, signed arm64 binary from the GitHub release.
#
# url, version and sha256 are written by homebrew/update_formula.py, which the release
# workflow (.github/workflows/release.yml) runs on the tarball it has just built and signed.
# Checked in CI by tests/meta/test_homebrew.py (ruby -c and homebrew/test/formula_harness.rb).
class Afmd < Formula
  desc "Local AI daemon for Apple Silicon: MLX models behind the OpenAI API"
  homepage "https://github.com/afmd-project/afmd"
  url "https://github.com/afmd-project/afmd/releases/download/v0.1.0/afmd-0.1.0-macos-arm64.tar.gz"
  version "0.1.0"
  sha256 "0000000000000000000000000000000000000000000000000000000000000000"
  license "MIT"

  depends_on arch: :arm64
  depends_on :macos

  # The frozen app is signed and notarized as built; Homebrew must not rewrite or prune it.
  skip_clean "libexec"

  def install
    # The tarball holds afmd (the executable), _internal/ (the frozen Python app) and
    # config.example.toml. The executable finds _internal/ next to itself, so both stay
    # together in libexec and bin gets a small exec wrapper.
    libexec.install "afmd", "_internal"
    bin.write_exec_script libexec/"afmd"
    pkgshare.install "config.example.toml"
  end

  def post_install
    # Runs with etc = $(brew --prefix)/etc, on install and on every upgrade: the user's
    # config is created once and never overwritten; the current example stays in pkgshare.
    (etc/"afmd").mkpath
    config = etc/"afmd/config.toml"
    cp pkgshare/"config.example.toml", config unless config.exist?
    (var/"afmd").mkpath
    (var/"log").mkpath
  end

  def caveats
    <<~EOS
      afmd serves the OpenAI Chat Completions API at:
        http://127.0.0.1:9999/v1
      (any API key works unless you set server.api_key).

      Your configuration is:
        #{etc}/afmd/config.toml
      It is never overwritten on upgrade; the current example is
        #{opt_pkgshare}/config.example.toml

      Start it now and at login:
        brew services start afmd
      Logs: #{var}/log/afmd.log    Diagnose a setup: afmd doctor
      Out of the box afmd serves the built-in "demo" model (random weights, nonsense text);
      configure a real MLX model in [[models.model]], or, on macOS 26 with Apple
      Intelligence on, set [models] default = "system" for Apple's on-device model.
    EOS
  end

  service do
    run [opt_bin/"afmd", "serve", "--config", etc/"afmd/config.toml"]
    keep_alive true
    working_dir var/"afmd"
    log_path var/"log/afmd.log"
    error_log_path var/"log/afmd.log"
  end

  test do
    assert_match "afmd #{version}", shell_output("#{bin}/afmd version")
    (testpath/"config.toml").write <<~TOML
      [server]
      port = 19999
    TOML
    assert_match "OK", shell_output("#{bin}/afmd check-config #{testpath}/config.toml")
    assert_match "OK", shell_output("#{bin}/afmd check-config #{pkgshare}/config.example.toml")
  end
end
