# Loads homebrew/afmd.rb against a minimal stand-in of Homebrew's Formula DSL and checks it,
# without Homebrew or macOS (plain Ruby >= 3.0, e.g. Debian's `ruby`):
#
#   ruby homebrew/test/formula_harness.rb homebrew/afmd.rb [--expect-url URL]
#        [--expect-sha256 HEX] [--expect-version V] [--require-filled]
#
# Checks the metadata (url, version, sha256, depends_on), runs `install` and `post_install`
# on a fake tarball in a temporary prefix (twice, to prove an edited config survives an
# upgrade), evaluates the `service` block, and runs the `test` block against a stub `afmd`
# that records how it was called. Prints one JSON object (the facts it found) and exits 0
# when every check passed, 1 otherwise (failures listed on stderr).

require "fileutils"
require "json"
require "optparse"
require "pathname"
require "tmpdir"

# ---------------------------------------------------------------------------- the stand-in

# Homebrew's Pathname extensions the formula uses.
class Pathname
  def install(*sources)
    mkpath
    sources.flatten.each do |source|
      if source.is_a?(Hash)
        source.each { |from, to| FileUtils.mv(from.to_s, (self / to.to_s).to_s) }
      else
        FileUtils.mv(source.to_s, (self / File.basename(source.to_s)).to_s)
      end
    end
  end

  def write_exec_script(*targets)
    mkpath
    targets.flatten.each do |target|
      script = self / File.basename(target.to_s)
      script.write("#!/bin/bash\nexec \"#{target}\" \"$@\"\n")
      script.chmod(0o755)
    end
  end
end

class AssertionFailure < StandardError; end

# The DSL: class-level metadata plus instance-level paths rooted in a temporary "prefix".
class Formula
  class << self
    def facts
      @facts ||= { "depends_on" => [], "skip_clean" => [] }
    end

    %w[desc homepage url version sha256 license].each do |name|
      define_method(name) do |value = nil|
        value.nil? ? facts[name] : (facts[name] = value)
      end
    end

    def depends_on(spec)
      facts["depends_on"] << spec
    end

    def skip_clean(*paths)
      facts["skip_clean"].concat(paths.map(&:to_s))
    end

    def service(&block)
      @service_block = block
    end

    def test(&block)
      @test_block = block
    end

    def livecheck(&block); end

    attr_reader :service_block, :test_block
  end

  attr_reader :root, :commands

  def initialize(root)
    @root = Pathname(root)
    @commands = []
  end

  def name = "afmd"
  def version = self.class.version
  def prefix = root / "Cellar" / name / version
  def opt_prefix = root / "opt" / name
  def bin = prefix / "bin"
  def libexec = prefix / "libexec"
  def pkgshare = prefix / "share" / name
  def opt_bin = opt_prefix / "bin"
  def opt_pkgshare = opt_prefix / "share" / name
  def etc = root / "etc"
  def var = root / "var"
  def testpath = @testpath ||= Pathname(Dir.mktmpdir("testpath", root.to_s))

  def cp(src, dst)
    FileUtils.cp(src.to_s, dst.to_s)
  end

  def shell_output(cmd, expected = 0)
    @commands << cmd
    out = IO.popen(["/bin/sh", "-c", cmd], err: [:child, :out], &:read)
    status = $?.exitstatus
    raise AssertionFailure, "`#{cmd}` exited #{status}, expected #{expected}: #{out}" if status != expected

    out
  end

  def assert_match(pattern, string)
    ok = pattern.is_a?(Regexp) ? pattern.match?(string) : string.include?(pattern.to_s)
    raise AssertionFailure, "#{pattern.inspect} not found in #{string.inspect}" unless ok
  end

  def assert_equal(expected, actual)
    raise AssertionFailure, "expected #{expected.inspect}, got #{actual.inspect}" unless expected == actual
  end
end

# What `service do ... end` builds; unknown names (opt_bin, etc, var) go to the formula.
class ServiceStandIn
  attr_reader :fields

  def initialize(formula)
    @formula = formula
    @fields = {}
  end

  %w[run keep_alive working_dir log_path error_log_path environment_variables run_type
     process_type].each do |name|
    define_method(name) { |*args| @fields[name] = args.length == 1 ? args.first : args }
  end

  def method_missing(name, *args, &block)
    @formula.respond_to?(name) ? @formula.public_send(name, *args, &block) : super
  end

  def respond_to_missing?(name, include_private = false)
    @formula.respond_to?(name) || super
  end
end

# ---------------------------------------------------------------------------- the checks

options = {}
OptionParser.new do |o|
  o.on("--expect-url URL") { |v| options[:url] = v }
  o.on("--expect-sha256 HEX") { |v| options[:sha256] = v }
  o.on("--expect-version V") { |v| options[:version] = v }
  o.on("--require-filled") { options[:filled] = true }
end.parse!
formula_path = File.expand_path(ARGV.fetch(0) { abort "usage: formula_harness.rb FORMULA.rb [options]" })

load formula_path
klass = Object.const_get(:Afmd)
facts = klass.facts
failures = []
check = lambda do |ok, message|
  failures << message unless ok
end

version = facts["version"].to_s
placeholder = facts["sha256"].to_s.match?(/\A0{64}\z/)
check.call(version.match?(/\A\d+\.\d+\.\d+([.-][0-9A-Za-z.]+)?\z/), "version #{version.inspect} is not x.y.z")
check.call(facts["desc"].to_s.length.between?(10, 80), "desc missing or longer than 80 characters")
check.call(facts["homepage"].to_s.start_with?("https://"), "homepage is not https")
url_pattern = %r{\Ahttps://github\.com/[^/]+/[^/]+/releases/download/v#{Regexp.escape(version)}/afmd-#{Regexp.escape(version)}-macos-arm64\.tar\.gz\z}
check.call(url_pattern.match?(facts["url"].to_s), "url #{facts["url"].inspect} is not the v#{version} macos-arm64 release tarball")
check.call(facts["sha256"].to_s.match?(/\A[0-9a-f]{64}\z/), "sha256 is not 64 lowercase hex digits")
check.call(facts["depends_on"].include?({ arch: :arm64 }), "missing depends_on arch: :arm64")
check.call(facts["depends_on"].include?(:macos), "missing depends_on :macos")
check.call(!(options[:filled] && placeholder), "sha256 is still the placeholder")
check.call(options[:url].nil? || facts["url"] == options[:url], "url is #{facts["url"]}, expected #{options[:url]}")
check.call(options[:sha256].nil? || facts["sha256"] == options[:sha256], "sha256 is #{facts["sha256"]}, expected #{options[:sha256]}")
check.call(options[:version].nil? || version == options[:version], "version is #{version}, expected #{options[:version]}")

example_config = File.expand_path("../../config.example.toml", __dir__)
report = { "formula" => formula_path, "placeholder_sha256" => placeholder }
report.merge!(facts.transform_values { |v| v.is_a?(Array) ? v.map(&:inspect) : v })

Dir.mktmpdir("afmd-formula") do |tmp|
  root = Pathname(tmp)

  # A fake release tarball, unpacked: a stub afmd that records its arguments.
  unpack = lambda do
    build = root / "buildpath-#{rand(1 << 30)}"
    (build / "_internal").mkpath
    (build / "_internal" / "base_library.zip").write("stub")
    (build / "afmd").write(<<~SH)
      #!/bin/sh
      echo "$*" >> "#{root}/afmd-calls.log"
      case "$1" in
        version) echo "afmd #{version}" ;;
        check-config) if [ -f "$2" ]; then echo "$2: OK (default model demo)"; else echo "missing $2" >&2; exit 2; fi ;;
        *) echo "unexpected: $*" >&2; exit 2 ;;
      esac
    SH
    (build / "afmd").chmod(0o755)
    FileUtils.cp(example_config, (build / "config.example.toml").to_s)
    build
  end

  # 1. install + post_install, as `brew install` does.
  formula = klass.new(root)
  Dir.chdir(unpack.call) do
    formula.install
  end
  formula.post_install
  FileUtils.mkdir_p(formula.opt_prefix.dirname.to_s)
  FileUtils.ln_s(formula.prefix.to_s, formula.opt_prefix.to_s)
  config = formula.etc / "afmd" / "config.toml"
  check.call((formula.libexec / "afmd").executable?, "libexec/afmd not installed")
  check.call((formula.libexec / "_internal").directory?, "libexec/_internal not installed")
  check.call((formula.bin / "afmd").executable?, "bin/afmd missing")
  check.call(config.file? && config.read == File.read(example_config),
             "etc/afmd/config.toml is not config.example.toml")
  check.call((formula.pkgshare / "config.example.toml").file?, "pkgshare/config.example.toml missing")
  check.call((formula.var / "afmd").directory?, "var/afmd (the service's working dir) not created")
  version_out = IO.popen([(formula.bin / "afmd").to_s, "version"], &:read)
  check.call(version_out.strip == "afmd #{version}", "bin/afmd does not run libexec/afmd: #{version_out.inspect}")

  # 2. The user edits the config; an upgrade (install + post_install again) keeps it.
  edited = "# edited by the user\n[server]\nport = 8080\n"
  config.write(edited)
  FileUtils.rm_rf(formula.prefix.to_s)
  Dir.chdir(unpack.call) do
    formula.install
  end
  formula.post_install
  check.call(config.read == edited, "post_install overwrote the user's edited config")
  report["config_kept_on_upgrade"] = config.read == edited

  # 3. The service block.
  service = ServiceStandIn.new(formula)
  service.instance_exec(&klass.service_block) if klass.service_block
  fields = service.fields
  expected_run = [formula.opt_bin / "afmd", "serve", "--config", formula.etc / "afmd/config.toml"]
  check.call(fields["run"].is_a?(Array) && fields["run"].map(&:to_s) == expected_run.map(&:to_s),
             "service run is #{fields["run"].inspect}, expected #{expected_run.map(&:to_s)}")
  check.call(fields["keep_alive"] == true, "service keep_alive is not true")
  check.call(fields["log_path"].to_s == (formula.var / "log/afmd.log").to_s, "service log_path is not var/log/afmd.log")
  check.call(fields["error_log_path"].to_s == (formula.var / "log/afmd.log").to_s,
             "service error_log_path is not var/log/afmd.log")
  check.call(fields["working_dir"].to_s.start_with?((formula.var / "afmd").to_s),
             "service working_dir is not under var/afmd")
  report["service"] = fields.transform_values { |v| v.is_a?(Array) ? v.map(&:to_s) : v.to_s }

  # 4. The test block, against the stub.
  File.write((root / "afmd-calls.log").to_s, "")
  begin
    formula.instance_exec(&klass.test_block)
    report["test_block"] = "passed"
  rescue AssertionFailure => e
    failures << "test block failed: #{e.message}"
    report["test_block"] = "failed"
  end
  calls = File.read((root / "afmd-calls.log").to_s).lines.map(&:strip)
  report["test_calls"] = calls
  check.call(calls.include?("version"), "test block does not run `afmd version`")
  check.call(calls.any? { |c| c.start_with?("check-config ") }, "test block does not run `afmd check-config`")

  # 5. Caveats: the endpoint and where the config lives.
  caveats = formula.caveats.to_s
  check.call(caveats.include?("http://127.0.0.1:9999/v1"), "caveats do not name the endpoint")
  check.call(caveats.include?("#{formula.etc}/afmd/config.toml"), "caveats do not say where the config is")
  report["caveats"] = caveats
end

report["failures"] = failures
puts JSON.generate(report)
failures.each { |f| warn "FAIL: #{f}" }
exit(failures.empty? ? 0 : 1)
