// Package tests holds the end-to-end tests: the real mooncake-fs binary
// runs in its own process on a fresh mountpoint, and the mount is driven
// only from child processes (cp, dd, tar, rsync, python3, a probe binary).
// The test process itself never does file I/O on a mount: a daemon bug
// that hangs a request must hang a child, which a timeout then kills, and
// never the test binary.
//
// The tests need root and /dev/fuse; without them every daemon test skips
// with the reason (TestMain prints it once).
package tests

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// python is Debian's interpreter, which has numpy; the python3 first on
// PATH may be another one.
const python = "/usr/bin/python3"

const (
	// readyTimeout bounds the wait for the READY line.
	readyTimeout = 60 * time.Second
	// stopTimeout is how long a daemon may take to exit after SIGTERM
	// before it is killed (and the test fails).
	stopTimeout = 20 * time.Second
	// cmdTimeout bounds every child command: a hung request fails the
	// test instead of hanging the suite.
	cmdTimeout = 2 * time.Minute
	// waitTimeout bounds waits for asynchronous effects (the kernel sends
	// RELEASE after close(2) returns).
	waitTimeout = 30 * time.Second
)

var (
	// skipReason is why daemon tests cannot run here; empty when they can.
	skipReason string
	// binDir holds the binaries built once by TestMain.
	binDir string
	// mountBase holds every test's mountpoint. It is mode 0755 (unlike
	// t.TempDir) so that the unprivileged user of the permission tests can
	// reach the mounts.
	mountBase string
	mountSeq  atomic.Int64
)

func daemonBin() string { return filepath.Join(binDir, "mooncake-fs") }
func probeBin() string  { return filepath.Join(binDir, "probe") }

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	switch {
	case os.Geteuid() != 0:
		skipReason = "end-to-end tests need root (the daemon mounts with mount(2) directly)"
	default:
		if _, err := os.Stat("/dev/fuse"); err != nil {
			skipReason = fmt.Sprintf("end-to-end tests need /dev/fuse: %v", err)
		}
	}
	if skipReason != "" {
		fmt.Fprintf(os.Stderr, "tests: skipping every daemon test: %s\n", skipReason)
		return m.Run()
	}
	tmp, err := os.MkdirTemp("", "mooncake-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "tests:", err)
		return 1
	}
	binDir = filepath.Join(tmp, "bin")
	mountBase = filepath.Join(tmp, "mnt")
	for _, d := range []string{tmp, binDir, mountBase} {
		if err := os.MkdirAll(d, 0o755); err != nil || os.Chmod(d, 0o755) != nil {
			fmt.Fprintln(os.Stderr, "tests: make", d, err)
			os.RemoveAll(tmp)
			return 1
		}
	}
	if err := build(binDir); err != nil {
		fmt.Fprintln(os.Stderr, "tests:", err)
		os.RemoveAll(tmp)
		return 1
	}
	code := m.Run()
	// A test that failed badly may leave a mount behind; never remove a
	// tree that still has one (RemoveAll would walk into it).
	if mounted, _ := mountsUnder(mountBase); len(mounted) > 0 {
		fmt.Fprintf(os.Stderr, "tests: mounts left behind, not removing %s: %v\n", tmp, mounted)
		return max(code, 1)
	}
	os.RemoveAll(tmp)
	return code
}

// build compiles the daemon and the probe helper from the module root.
func build(dir string) error {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return errors.New("go env GOMOD: not inside the module")
	}
	cmd := exec.Command("go", "build", "-o", dir+"/", "./cmd/mooncake-fs", "./tests/internal/probe")
	cmd.Dir = filepath.Dir(gomod)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build: %w\n%s", err, out)
	}
	return nil
}

// requireE2E skips t where the daemon cannot run.
func requireE2E(t testing.TB) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

// requireTools skips t when a program it drives is not installed.
func requireTools(t testing.TB, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			t.Skipf("%s is not installed: %v", n, err)
		}
	}
}

// requireNumpy skips t without Debian's python3 and numpy.
func requireNumpy(t testing.TB) {
	t.Helper()
	requireTools(t, python)
	if out, err := exec.Command(python, "-c", "import numpy").CombinedOutput(); err != nil {
		t.Skipf("%s has no numpy (apt-get install python3-numpy): %v\n%s", python, err, out)
	}
}

// syncBuffer collects a daemon's log; the daemon writes while tests read.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// daemon is one mooncake-fs mount process.
type daemon struct {
	dir  string // the mountpoint
	args []string
	cmd  *exec.Cmd
	log  *syncBuffer
	done chan struct{} // closed when the process has exited
	err  error         // of Wait, valid once done is closed
	// killed is set when the test killed the daemon on purpose.
	killed   atomic.Bool
	stopOnce sync.Once
}

// newMountpoint returns a fresh, empty directory for a mount. It is
// removed at the end of the test, after every daemon on it has stopped.
func newMountpoint(t testing.TB) string {
	t.Helper()
	requireE2E(t)
	name := regexp.MustCompile(`[^A-Za-z0-9_-]+`).ReplaceAllString(t.Name(), "_")
	dir := filepath.Join(mountBase, fmt.Sprintf("%s-%d", name, mountSeq.Add(1)))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if mounted(dir) {
			t.Errorf("%s is still mounted at the end of the test; detaching it", dir)
			_ = unix.Unmount(dir, unix.MNT_DETACH)
		}
		if err := os.Remove(dir); err != nil {
			t.Errorf("remove mountpoint: %v", err)
		}
	})
	return dir
}

// startDaemon mounts a fresh store on a new mountpoint with the given
// mount flags and waits until it serves.
func startDaemon(t testing.TB, opts ...string) *daemon {
	t.Helper()
	return startDaemonAt(t, newMountpoint(t), opts...)
}

// startDaemonAt starts "mooncake-fs mount opts... dir" and waits for its
// READY line. At the end of the test the daemon gets SIGTERM and must exit
// cleanly; its log is dumped if the test failed.
func startDaemonAt(t testing.TB, dir string, opts ...string) *daemon {
	t.Helper()
	return startDaemonEnv(t, dir, nil, opts...)
}

// startDaemonEnv is startDaemonAt with env (NAME=value) in place of
// the test's variables of those names.
func startDaemonEnv(t testing.TB, dir string, env []string, opts ...string) *daemon {
	t.Helper()
	requireE2E(t)
	d := &daemon{dir: dir, log: &syncBuffer{}, done: make(chan struct{})}
	d.args = append(append([]string{"mount"}, opts...), dir)
	d.cmd = exec.Command(daemonBin(), d.args...)
	if env != nil {
		d.cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool {
			return slices.ContainsFunc(env, func(e string) bool {
				name, _, _ := strings.Cut(e, "=")
				return strings.HasPrefix(kv, name+"=")
			})
		})
		d.cmd.Env = append(d.cmd.Env, env...)
	}
	d.cmd.Stderr = d.log
	// Its own process group, so that a signal meant for the test binary's
	// group does not reach it; and SIGTERM if the test binary dies, so that
	// a killed test run does not leave a serving mount behind.
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	d.cmd.Stdout = pw
	if err := d.cmd.Start(); err != nil {
		pr.Close()
		pw.Close()
		t.Fatalf("start %s: %v", daemonBin(), err)
	}
	pw.Close()
	t.Cleanup(func() { d.stop(t) })
	go func() {
		d.err = d.cmd.Wait()
		close(d.done)
	}()

	ready := make(chan struct{})
	want := "READY " + dir
	go func() {
		sc := bufio.NewScanner(pr)
		seen := false
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintf(d.log, "[stdout] %s\n", line)
			if !seen && line == want {
				seen = true
				close(ready)
			}
		}
		pr.Close()
	}()

	timer := time.NewTimer(readyTimeout)
	defer timer.Stop()
	select {
	case <-ready:
	case <-d.done:
		t.Fatalf("daemon %v exited before READY: %v", d.args, d.err)
	case <-timer.C:
		t.Fatalf("daemon %v: no %q line within %v", d.args, want, readyTimeout)
	}
	t.Logf("daemon pid %d serving %s (%s)", d.cmd.Process.Pid, dir, strings.Join(opts, " "))
	return d
}

// exited reports whether the daemon process is gone.
func (d *daemon) exited() bool {
	select {
	case <-d.done:
		return true
	default:
		return false
	}
}

// kill9 kills the daemon with SIGKILL and waits for it to be gone,
// leaving its mount dead (requests fail with ENOTCONN).
func (d *daemon) kill9(t testing.TB) {
	t.Helper()
	d.killed.Store(true)
	_ = d.cmd.Process.Signal(syscall.SIGKILL)
	<-d.done
}

// stop sends SIGTERM, waits for a clean exit (SIGKILL after stopTimeout),
// checks the exit and the log, and dumps the log if the test failed. Only
// the first call does anything.
func (d *daemon) stop(t testing.TB) {
	d.stopOnce.Do(func() { d.stopNow(t) })
}

func (d *daemon) stopNow(t testing.TB) {
	if !d.exited() {
		_ = d.cmd.Process.Signal(syscall.SIGTERM)
		timer := time.NewTimer(stopTimeout)
		select {
		case <-d.done:
		case <-timer.C:
			t.Errorf("daemon on %s did not exit within %v of SIGTERM; killing it", d.dir, stopTimeout)
			d.killed.Store(true)
			_ = d.cmd.Process.Signal(syscall.SIGKILL)
			<-d.done
		}
		timer.Stop()
	}
	if d.err != nil && !d.killed.Load() {
		t.Errorf("daemon on %s exited with %v", d.dir, d.err)
	}
	if d.killed.Load() && mounted(d.dir) {
		// The kernel keeps a dead mount until someone detaches it.
		if err := unix.Unmount(d.dir, unix.MNT_DETACH); err != nil {
			t.Errorf("detach dead mount %s: %v", d.dir, err)
		}
	}
	log := d.log.String()
	for _, bad := range []string{"panic:", "fatal error:", "WARNING: DATA RACE"} {
		if strings.Contains(log, bad) {
			t.Errorf("daemon log of %s contains %q", d.dir, bad)
		}
	}
	if t.Failed() {
		t.Logf("daemon %v log:\n%s", d.args, log)
	}
}

// status is the part of "mooncake-fs status --json" the tests read.
type status struct {
	Capacity    uint64 `json:"capacity"`
	Used        uint64 `json:"used"`
	Free        uint64 `json:"free"`
	Objects     int    `json:"objects"`
	OpenObjects int    `json:"open_objects"`
	Evict       struct {
		Enabled      bool   `json:"enabled"`
		Evictions    uint64 `json:"evictions"`
		EvictedBytes uint64 `json:"evicted_bytes"`
	} `json:"evict"`
	Commits   uint64 `json:"commits"`
	Revokes   uint64 `json:"revokes"`
	OpenFiles struct {
		Used  uint64 `json:"used"`
		Limit uint64 `json:"limit"`
	} `json:"open_files"`
	OpenDirs int64 `json:"open_dirs"`
	Metadata struct {
		Used  uint64 `json:"used"`
		Limit uint64 `json:"limit"`
	} `json:"metadata_bytes"`
	Memory struct {
		Hugepages bool   `json:"hugepages"`
		HeapBytes uint64 `json:"heap_bytes"`
		HeapLimit int64  `json:"heap_limit_bytes"`
	} `json:"memory"`
	Segments []struct {
		Size uint64 `json:"size"`
		Used uint64 `json:"used"`
	} `json:"segments"`
	Transfer struct {
		BytesWritten uint64 `json:"BytesWritten"`
		BytesRead    uint64 `json:"BytesRead"`
	} `json:"transfer"`
}

// statusFields are the documented top-level fields of the status JSON.
var statusFields = []string{"capacity", "used", "free", "objects", "open_objects", "open_files", "metadata_bytes", "evict", "commits", "revokes", "memory", "segments"}

// status runs "mooncake-fs status --json" in a child process.
func (d *daemon) status(t testing.TB) status {
	t.Helper()
	out := run(t, daemonBin(), "status", "--json", d.dir)
	var raw map[string]json.RawMessage
	if err := json.Unmarshal([]byte(out), &raw); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	for _, f := range statusFields {
		if _, ok := raw[f]; !ok {
			t.Errorf("status --json has no field %q:\n%s", f, out)
		}
	}
	var s status
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	return s
}

// checkAlive fails t unless the daemon still runs and answers status.
func (d *daemon) checkAlive(t testing.TB) status {
	t.Helper()
	if d.exited() {
		t.Fatalf("daemon on %s died: %v", d.dir, d.err)
	}
	return d.status(t)
}

// path joins names under the mountpoint.
func (d *daemon) path(names ...string) string {
	return filepath.Join(append([]string{d.dir}, names...)...)
}

// publicDir makes the directory "pub" of d's mount, which every user may
// write (mode 0777, as the tests' unprivileged users need), and returns
// its path.
func (d *daemon) publicDir(t testing.TB) string {
	t.Helper()
	pub := d.path("pub")
	run(t, "mkdir", "-m", "0777", pub)
	return pub
}

// waitFor polls cond until it holds, failing t after waitTimeout with the
// last state cond described. It is for effects the kernel makes
// asynchronous (RELEASE comes after close(2) returns), never to assert on
// speed.
func waitFor(t testing.TB, what string, cond func() (ok bool, state string)) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for delay := 10 * time.Millisecond; ; delay = min(2*delay, 500*time.Millisecond) {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("still waiting after %v for %s; last: %s", waitTimeout, what, state)
		}
		time.Sleep(delay)
	}
}

// quiesce waits until no object is open in the daemon (the kernel has sent
// every RELEASE) and returns the status then.
func (d *daemon) quiesce(t testing.TB) status {
	t.Helper()
	var s status
	waitFor(t, "open_objects == 0", func() (bool, string) {
		s = d.status(t)
		return s.OpenObjects == 0, fmt.Sprintf("%+v", s)
	})
	return s
}

// bg is a child process running in the background.
type bg struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *syncBuffer
	done  chan struct{}
	err   error
}

// background starts a child command; it is killed at the end of the test
// if still running (before any daemon is stopped). Its stdin is a pipe
// the test writes to through b.stdin.
func background(t testing.TB, name string, args ...string) *bg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	b := &bg{name: describe(name, args), out: &syncBuffer{}, done: make(chan struct{})}
	b.cmd = command(ctx, name, args...)
	b.cmd.Stdout = b.out
	b.cmd.Stderr = b.out
	var err error
	if b.stdin, err = b.cmd.StdinPipe(); err != nil {
		cancel()
		t.Fatal(err)
	}
	if err := b.cmd.Start(); err != nil {
		cancel()
		t.Fatalf("%s: %v", b.name, err)
	}
	go func() {
		b.err = b.cmd.Wait()
		cancel()
		close(b.done)
	}()
	t.Cleanup(func() {
		cancel()
		<-b.done
	})
	return b
}

// waitOutput waits until the command's output contains s.
func (b *bg) waitOutput(t testing.TB, s string) {
	t.Helper()
	waitFor(t, fmt.Sprintf("%q from %s", s, b.name), func() (bool, string) {
		out := b.out.String()
		if strings.Contains(out, s) {
			return true, out
		}
		select {
		case <-b.done:
			t.Fatalf("%s exited (%v) without printing %q:\n%s", b.name, b.err, s, out)
		default:
		}
		return false, out
	})
}

// wait waits for the command and returns its output and error.
func (b *bg) wait() (string, error) {
	<-b.done
	return b.out.String(), b.err
}

// mustWait fails t unless the command succeeded.
func (b *bg) mustWait(t testing.TB) string {
	t.Helper()
	out, err := b.wait()
	if err != nil {
		t.Fatalf("%s: %v\n%s", b.name, err, out)
	}
	return out
}

// command returns a child command bounded by cmdTimeout; at the deadline
// its whole process group is killed.
func command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// runErr runs a child command with stdout and stderr captured together.
func runErr(name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	defer cancel()
	var out bytes.Buffer
	cmd := command(ctx, name, args...)
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	if ctx.Err() != nil {
		err = fmt.Errorf("%w (killed after %v)", err, cmdTimeout)
	}
	return out.String(), err
}

// run runs a child command and fails t with its output if it fails.
func run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := runErr(name, args...)
	if err != nil {
		t.Fatalf("%s: %v\n%s", describe(name, args), err, out)
	}
	return out
}

// sh runs a shell script; args are $1, $2, ...
func sh(t testing.TB, script string, args ...string) string {
	t.Helper()
	return run(t, "sh", append([]string{"-c", script, "sh"}, args...)...)
}

func shErr(script string, args ...string) (string, error) {
	return runErr("sh", append([]string{"-c", script, "sh"}, args...)...)
}

// py runs a python3 script (Debian's, with numpy); args are sys.argv[1:].
func py(t testing.TB, script string, args ...string) string {
	t.Helper()
	requireTools(t, python)
	return run(t, python, append([]string{"-c", script}, args...)...)
}

// asNobody runs a shell script as uid/gid 65534 with no supplementary
// groups.
func asNobody(script string, args ...string) (string, error) {
	return runErr("setpriv", append([]string{"--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", script, "sh"}, args...)...)
}

// describe shortens a command line for failure messages (scripts are long).
func describe(name string, args []string) string {
	parts := []string{name}
	for _, a := range args {
		if len(a) > 120 {
			a = a[:120] + "..."
		}
		parts = append(parts, fmt.Sprintf("%q", a))
	}
	return strings.Join(parts, " ")
}

// pyResults parses "label=VALUE" lines printed by a python script.
func pyResults(out string) map[string]string {
	m := map[string]string{}
	for line := range strings.SplitSeq(out, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), "="); ok {
			m[k] = v
		}
	}
	return m
}

// checkResults compares pyResults of out with want (label -> "OK" or an
// errno name such as "ENAMETOOLONG"; several allowed values separated by
// "|").
func checkResults(t testing.TB, out string, want map[string]string) {
	t.Helper()
	got := pyResults(out)
	for label, w := range want {
		g, ok := got[label]
		if !ok {
			t.Errorf("%s: no result in output", label)
			continue
		}
		allowed := false
		for a := range strings.SplitSeq(w, "|") {
			allowed = allowed || g == a
		}
		if !allowed {
			t.Errorf("%s = %s, want %s", label, g, w)
		}
	}
	if t.Failed() {
		t.Logf("script output:\n%s", out)
	}
}

// pyErrnoPrelude defines try_(label, fn, *args): it prints label=OK or
// label=ERRNONAME and returns fn's result (None on error); and errname(n).
const pyErrnoPrelude = `
import errno, os, sys
def errname(n):
    # Linux aliases: one number, the name POSIX code usually means.
    return {errno.EOPNOTSUPP: "EOPNOTSUPP", errno.EAGAIN: "EAGAIN"}.get(n) or errno.errorcode.get(n, str(n))
def try_(label, fn, *a):
    try:
        r = fn(*a)
    except OSError as e:
        print(f"{label}={errname(e.errno)}", flush=True)
        return None
    print(f"{label}=OK", flush=True)
    return r
`

// writeRandom writes size pseudo-random bytes (from seed) to a local file.
func writeRandom(t testing.TB, path string, size int64, seed uint64) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	var key [32]byte
	for i := range 4 {
		key[i*8] = byte(seed >> (8 * i))
		key[i*8+1] = byte(i)
	}
	key[31] = byte(seed >> 56)
	r := rand.NewChaCha8(key)
	if _, err := io.CopyN(f, r, size); err != nil {
		f.Close()
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// mounted reports whether dir is a mount point (of any kind) according to
// /proc/self/mountinfo; it never touches dir itself.
func mounted(dir string) bool {
	ms, _ := mountsUnder(dir)
	for _, m := range ms {
		if m == dir {
			return true
		}
	}
	return false
}

// mountsUnder lists the mount points at or below dir.
func mountsUnder(dir string) ([]string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var out []string
	for line := range strings.SplitSeq(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescapeMountinfo(f[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	return out, nil
}

// unescapeMountinfo undoes the octal escapes (\040 for space) of
// /proc/self/mountinfo.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var c byte
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &c); err == nil {
				b.WriteByte(c)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

const (
	kiB = 1 << 10
	miB = 1 << 20
)
