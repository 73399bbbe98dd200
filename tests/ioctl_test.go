package tests

// End-to-end tests of the data-path ioctls through the Go client (package
// ioctl), run from child processes: tests/internal/ioctlclient does the
// ioctls and prints one JSON line per step; the CLI's put and get are run
// as "mooncake-fs put/get".

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	ioctlClientOnce sync.Once
	ioctlClientErr  error
)

// ioctlClientBin builds tests/internal/ioctlclient once, beside the
// daemon.
func ioctlClientBin(t testing.TB) string {
	t.Helper()
	requireE2E(t)
	bin := filepath.Join(binDir, "ioctlclient")
	ioctlClientOnce.Do(func() {
		cmd := exec.Command("go", "build", "-o", bin, "./internal/ioctlclient")
		if out, err := cmd.CombinedOutput(); err != nil {
			ioctlClientErr = fmt.Errorf("go build ioctlclient: %w\n%s", err, out)
		}
	})
	if ioctlClientErr != nil {
		t.Fatal(ioctlClientErr)
	}
	return bin
}

// step is one result line of ioctlclient.
type step struct {
	Step    string `json:"step"`
	OK      bool   `json:"ok"`
	Errno   string `json:"errno"`
	N       uint64 `json:"n"`
	Version uint64 `json:"version"`
	Detail  string `json:"detail"`
}

// steps parses ioctlclient's output: the steps in order, and by name (the
// last of each name).
func steps(t testing.TB, out string) ([]step, map[string]step) {
	t.Helper()
	var list []step
	byName := map[string]step{}
	for line := range strings.SplitSeq(out, "\n") {
		if !strings.HasPrefix(line, "{") {
			continue
		}
		var s step
		if err := json.Unmarshal([]byte(line), &s); err != nil {
			t.Fatalf("bad line %q: %v", line, err)
		}
		list = append(list, s)
		byName[s.Step] = s
	}
	return list, byName
}

// client runs ioctlclient and returns its steps.
func client(t testing.TB, args ...string) ([]step, map[string]step) {
	t.Helper()
	return steps(t, run(t, ioctlClientBin(t), args...))
}

// want checks that step name answered errno ("OK" for success).
func want(t testing.TB, m map[string]step, name, errno string) step {
	t.Helper()
	s, ok := m[name]
	switch {
	case !ok:
		t.Errorf("%s: no result", name)
	case errno == "OK" && !s.OK:
		t.Errorf("%s: %s (%s), want success", name, s.Errno, s.Detail)
	case errno != "OK" && s.Errno != errno:
		t.Errorf("%s: %s, want %s (%s)", name, orOK(s), errno, s.Detail)
	}
	return s
}

func orOK(s step) string {
	if s.OK {
		return "OK"
	}
	return s.Errno
}

// ioStatus is the part of the status the ioctl tests read.
type ioStatus struct {
	Registrations struct {
		Live  int64 `json:"live"`
		Total int64 `json:"total"`
		Bytes int64 `json:"bytes"`
	} `json:"registrations"`
	Transfer struct {
		BytesRead    uint64 `json:"BytesRead"`
		BytesWritten uint64 `json:"BytesWritten"`
		CopiedBytes  uint64 `json:"CopiedBytes"`
		Requests     uint64 `json:"Requests"`
	} `json:"transfer"`
}

func (d *daemon) ioStatus(t testing.TB) ioStatus {
	t.Helper()
	out := run(t, daemonBin(), "status", "--json", d.dir)
	var raw map[string]json.RawMessage
	if err := json.Unmarshal([]byte(out), &raw); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	if _, ok := raw["registrations"]; !ok {
		t.Fatalf("status --json has no registrations:\n%s", out)
	}
	var s ioStatus
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatal(err)
	}
	return s
}

// noRegistrations waits until every registration is released (the kernel
// sends RELEASE after close(2) returns) and returns the status then.
func (d *daemon) noRegistrations(t testing.TB) ioStatus {
	t.Helper()
	var s ioStatus
	waitFor(t, "registrations.live == 0", func() (bool, string) {
		s = d.ioStatus(t)
		return s.Registrations.Live == 0 && s.Registrations.Bytes == 0, fmt.Sprintf("%+v", s.Registrations)
	})
	return s
}

// TestIoctl runs the data-path commands against one daemon, one subtest
// at a time (the metrics and registration counts are daemon-wide).
func TestIoctl(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "256MiB", "--evict", "off")
	ioctlClientBin(t)
	for _, c := range []struct {
		name string
		fn   func(t *testing.T, d *daemon, dir string)
	}{
		{"RoundTrip", testIoctlRoundTrip},
		{"CrossPath", testIoctlCrossPath},
		{"CLI", testIoctlCLI},
		{"PartialGet", testIoctlPartialGet},
		{"Excl", testIoctlExcl},
		{"BatchMissing", testIoctlBatchMissing},
		{"KilledClient", testIoctlKilledClient},
		{"Concurrent", testIoctlConcurrent},
		{"PoolRegistrations", testIoctlPoolRegistrations},
		{"Metrics", testIoctlMetrics},
		{"BadInput", testIoctlBadInput},
	} {
		t.Run(c.name, func(t *testing.T) {
			d.checkAlive(t)
			dir := d.path(c.name)
			run(t, "mkdir", dir)
			c.fn(t, d, dir)
			d.checkAlive(t)
		})
	}
}

// testIoctlRoundTrip: every command once, from Go, checked by the client.
func testIoctlRoundTrip(t *testing.T, d *daemon, dir string) {
	list, _ := client(t, "roundtrip", dir)
	wantErr := map[string]string{"use_after_unregister": "EINVAL"}
	seen := 0
	for _, s := range list {
		seen++
		if w, ok := wantErr[s.Step]; ok {
			if s.Errno != w {
				t.Errorf("%s: %s (%s), want %s", s.Step, orOK(s), s.Detail, w)
			}
			continue
		}
		if !s.OK {
			t.Errorf("%s: %s: %s", s.Step, s.Errno, s.Detail)
		}
	}
	if seen < 20 {
		t.Errorf("roundtrip reported %d steps, want every one", seen)
	}
}

// testIoctlCrossPath: what an ioctl puts, read(2) reads, and what write(2)
// wrote, an ioctl gets; through process memory and registered buffers.
func testIoctlCrossPath(t *testing.T, d *daemon, dir string) {
	tmp := t.TempDir()
	local := filepath.Join(tmp, "local")
	writeRandom(t, local, 3*miB+5, 1)
	for _, mode := range []string{"vm", "buf"} {
		key := filepath.Join(dir, "put-"+mode)
		args := []string{"put", key, local}
		if mode == "buf" {
			args = []string{"put", "--buf", key, local}
		}
		_, m := client(t, args...)
		if s := want(t, m, "put", "OK"); s.N != 3*miB+5 {
			t.Errorf("put %s: %d B", mode, s.N)
		}
		run(t, "cmp", local, key)

		copied := filepath.Join(dir, "cp-"+mode)
		run(t, "cp", local, copied)
		got := filepath.Join(tmp, "got-"+mode)
		args = []string{"get", copied, got}
		if mode == "buf" {
			args = []string{"get", "--buf", copied, got}
		}
		_, m = client(t, args...)
		want(t, m, "get", "OK")
		run(t, "cmp", local, got)
	}
}

// testIoctlCLI: "mooncake-fs put" and "get" of files, pipes and empty
// files, with and without a progress bar.
func testIoctlCLI(t *testing.T, d *daemon, dir string) {
	tmp := t.TempDir()
	big, small, empty := filepath.Join(tmp, "big"), filepath.Join(tmp, "small"), filepath.Join(tmp, "empty")
	writeRandom(t, big, 70*miB+3, 2) // over the 64 MiB chunk: two GET_VMs
	writeRandom(t, small, 1000, 3)
	writeRandom(t, empty, 0, 4)
	for _, f := range []string{big, small, empty} {
		key := filepath.Join(dir, filepath.Base(f))
		run(t, daemonBin(), "put", f, key)
		run(t, "cmp", f, key)
		out := filepath.Join(tmp, filepath.Base(f)+".out")
		run(t, daemonBin(), "get", key, out)
		run(t, "cmp", f, out)
		// Through a pipe both ways: the staged paths.
		piped := key + ".piped"
		sh(t, `cat "$1" | "$2" put - "$3"`, f, daemonBin(), piped)
		sh(t, `"$1" get "$2" - | cmp "$3" -`, daemonBin(), piped, f)
	}
	// A progress bar when asked, on stderr; the data is the same.
	ctx := filepath.Join(dir, "progress")
	out, err := runErr(daemonBin(), "put", "--progress", "always", big, ctx)
	if err != nil || !strings.Contains(out, "store "+ctx) {
		t.Errorf("put --progress always: %v\n%s", err, out)
	}
	got := filepath.Join(tmp, "progress.out")
	out, err = runErr(daemonBin(), "get", "--progress", "always", ctx, got)
	if err != nil || !strings.Contains(out, "MiB") {
		t.Errorf("get --progress always: %v\n%s", err, out)
	}
	run(t, "cmp", big, got)
	// --excl: first writer wins, the value stays.
	if out, err := runErr(daemonBin(), "put", "--excl", small, ctx); err == nil || !strings.Contains(out, "file exists") {
		t.Errorf("put --excl over an existing key: %v\n%s", err, out)
	}
	run(t, "cmp", big, ctx)
	// Outside a mount nothing is created.
	outside := filepath.Join(tmp, "not-a-mount")
	if out, err := runErr(daemonBin(), "put", small, outside); err == nil || !strings.Contains(out, "not a mooncake-fs file") {
		t.Errorf("put outside a mount: %v\n%s", err, out)
	}
	if _, err := os.Stat(outside); !os.IsNotExist(err) {
		t.Errorf("put outside a mount created %s: %v", outside, err)
	}
	if out, err := runErr(daemonBin(), "get", filepath.Join(dir, "missing"), got); err == nil || !strings.Contains(out, "no such file") {
		t.Errorf("get of a missing key: %v\n%s", err, out)
	}
}

// testIoctlPartialGet: gets of any byte range; short at the end, empty at
// the end, ERANGE past it; through both kinds of buffer and both kinds of
// open.
func testIoctlPartialGet(t *testing.T, d *daemon, dir string) {
	tmp := t.TempDir()
	local := filepath.Join(tmp, "local")
	const size = miB + 7
	writeRandom(t, local, size, 5)
	data, err := os.ReadFile(local)
	if err != nil {
		t.Fatal(err)
	}
	key := filepath.Join(dir, "k")
	_, m := client(t, "put", key, local)
	want(t, m, "put", "OK")
	// MC_FLAG_PARENTS is for puts by name on a directory, not on a file.
	_, m = client(t, "put", "--parents", key, local)
	want(t, m, "put", "EINVAL")
	for _, c := range []struct {
		off, n int
		wantN  int
		errno  string
	}{
		{0, 10, 10, "OK"},
		{1000, 5000, 5000, "OK"},
		{4095, 4097, 4097, "OK"},
		{size - 10, 100, 10, "OK"}, // short at the end
		{size, 100, 0, "OK"},       // nothing left
		{size + 1, 10, 0, "ERANGE"},
		{0, 2 * size, size, "OK"},
	} {
		for _, mode := range []string{"vm", "buf", "vm-rw"} {
			out := filepath.Join(tmp, fmt.Sprintf("%s-%d-%d", mode, c.off, c.n))
			args := []string{"get", "--off", fmt.Sprint(c.off), "--len", fmt.Sprint(c.n)}
			switch mode {
			case "buf":
				args = append(args, "--buf")
			case "vm-rw":
				args = append(args, "--rw")
			}
			_, m := client(t, append(args, key, out)...)
			s := want(t, m, "get", c.errno)
			if c.errno != "OK" || !s.OK {
				continue
			}
			got, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			if int(s.N) != c.wantN || !bytes.Equal(got, data[c.off:c.off+c.wantN]) {
				t.Errorf("%s get %d B at %d: %d B (want %d), equal=%v", mode, c.n, c.off, s.N, c.wantN, bytes.Equal(got, data[c.off:min(len(data), c.off+len(got))]))
			}
		}
	}
}

// testIoctlExcl: two processes open the same new key and put with
// FlagExcl at once; exactly one wins and its value is the key's.
func testIoctlExcl(t *testing.T, d *daemon, dir string) {
	tmp := t.TempDir()
	locals := []string{filepath.Join(tmp, "a"), filepath.Join(tmp, "b")}
	writeRandom(t, locals[0], 200*kiB, 6)
	writeRandom(t, locals[1], 300*kiB, 7)
	for round := range 6 {
		key := filepath.Join(dir, fmt.Sprintf("race-%d", round))
		var bgs []*bg
		for i, l := range locals {
			args := []string{"put", "--excl", "--wait", key, l}
			if (round+i)%2 == 1 {
				args = []string{"put", "--excl", "--buf", "--wait", key, l}
			}
			bgs = append(bgs, background(t, ioctlClientBin(t), args...))
		}
		for _, b := range bgs {
			b.waitOutput(t, "ready")
		}
		for _, b := range bgs {
			fmt.Fprintln(b.stdin, "go")
		}
		winner := -1
		for i, b := range bgs {
			_, m := steps(t, b.mustWait(t))
			s := m["put"]
			switch {
			case s.OK && winner < 0:
				winner = i
			case s.OK:
				t.Errorf("round %d: both puts won", round)
			case s.Errno != "EEXIST":
				t.Errorf("round %d: loser answered %s (%s), want EEXIST", round, s.Errno, s.Detail)
			}
		}
		if winner < 0 {
			t.Errorf("round %d: nobody won", round)
			continue
		}
		run(t, "cmp", locals[winner], key)
	}
	// Over a key with a value, EXCL always loses.
	key := filepath.Join(dir, "race-0")
	_, m := client(t, "put", "--excl", key, locals[0])
	want(t, m, "put", "EEXIST")
}

// testIoctlBatchMissing: a batch with some missing keys and parents
// answers per key; the rest succeed.
func testIoctlBatchMissing(t *testing.T, d *daemon, dir string) {
	run(t, "mkdir", filepath.Join(dir, "e"))
	_, m := client(t, "batch-put", dir, "a", "b", "nodir/x", "e/f")
	want(t, m, "key:a", "OK")
	want(t, m, "key:b", "OK")
	want(t, m, "key:nodir/x", "ENOENT")
	want(t, m, "key:e/f", "OK")
	_, m = client(t, "batch-get", dir, "a", "missing", "b", "nodir/x", "e/f", "e/missing")
	for k, w := range map[string]string{"a": "OK", "missing": "ENOENT", "b": "OK", "nodir/x": "ENOENT", "e/f": "OK", "e/missing": "ENOENT"} {
		want(t, m, "key:"+k, w)
	}
	// More keys than one call holds, missing ones among them.
	var keys, mixed []string
	for i := range 150 {
		keys = append(keys, fmt.Sprintf("many-%03d", i))
	}
	list, _ := client(t, append([]string{"batch-put", dir}, keys...)...)
	if len(list) != len(keys) {
		t.Fatalf("batch-put of %d keys: %d results", len(keys), len(list))
	}
	for i, k := range keys {
		mixed = append(mixed, k)
		if i%10 == 0 {
			mixed = append(mixed, "gone-"+k)
		}
	}
	list, m = client(t, append([]string{"batch-get", dir}, mixed...)...)
	if len(list) != len(mixed) {
		t.Fatalf("batch-get of %d keys: %d results", len(mixed), len(list))
	}
	for _, k := range mixed {
		if strings.HasPrefix(k, "gone-") {
			want(t, m, "key:"+k, "ENOENT")
		} else {
			want(t, m, "key:"+k, "OK")
		}
	}
	// Batches of more calls than one, their calls overlapping (distinct
	// keys) or in order (a key twice: the later value stays).
	_, m = client(t, "batch-order", dir)
	for _, s := range []string{"distinct", "twice", "read"} {
		want(t, m, s, "OK")
	}
	// What a batch put, read(2) reads.
	out := sh(t, `wc -c < "$1/e/f"`, dir)
	if strings.TrimSpace(out) != fmt.Sprint(keyValueLen("e/f")) {
		t.Errorf("e/f through read(2): %s B, want %d", out, keyValueLen("e/f"))
	}
}

// testIoctlKilledClient: a client killed with registrations outstanding
// leaks none.
func testIoctlKilledClient(t *testing.T, d *daemon, dir string) {
	before := d.noRegistrations(t)
	b := background(t, ioctlClientBin(t), "hold", dir)
	b.waitOutput(t, "ready 4")
	s := d.ioStatus(t)
	if got := s.Registrations.Live; got != 4 {
		t.Errorf("live registrations %d while the client holds 4", got)
	}
	if got := s.Registrations.Total - before.Registrations.Total; got != 4 {
		t.Errorf("%d registrations made, want 4", got)
	}
	if want := int64(1<<20 + 2<<20 + 1<<20 + 8*64<<10); s.Registrations.Bytes != want {
		t.Errorf("registered bytes %d, want %d", s.Registrations.Bytes, want)
	}
	if err := syscall.Kill(b.cmd.Process.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	b.wait()
	after := d.noRegistrations(t)
	if after.Registrations.Total != s.Registrations.Total {
		t.Errorf("registrations made after the kill: %d -> %d", s.Registrations.Total, after.Registrations.Total)
	}
}

// testIoctlConcurrent: clients put and get their own keys and a shared
// one at once, through files, pool leases and batches; every value read
// is whole.
func testIoctlConcurrent(t *testing.T, d *daemon, dir string) {
	const clients, iters = 4, 60
	var bgs []*bg
	for i := range clients {
		bgs = append(bgs, background(t, ioctlClientBin(t), "stress", dir, fmt.Sprint(i), fmt.Sprint(iters)))
	}
	for i, b := range bgs {
		_, m := steps(t, b.mustWait(t))
		if s := want(t, m, "stress", "OK"); s.OK && s.N != 4*iters {
			t.Errorf("client %d: %d ops, want %d", i, s.N, 4*iters)
		}
		if t.Failed() {
			t.Logf("client %d:\n%s", i, b.out.String())
		}
	}
	d.noRegistrations(t)
}

// testIoctlPoolRegistrations: each pool registers exactly once, however
// many leases it serves, and gives its registration back.
func testIoctlPoolRegistrations(t *testing.T, d *daemon, dir string) {
	before := d.noRegistrations(t)
	const pools = 5
	list, _ := client(t, "pools", dir, fmt.Sprint(pools))
	if len(list) != pools {
		t.Fatalf("%d results for %d pools", len(list), pools)
	}
	for _, s := range list {
		if !s.OK || s.N != 1 {
			t.Errorf("%s: %s, %d registrations (%s)", s.Step, orOK(s), s.N, s.Detail)
		}
	}
	after := d.noRegistrations(t)
	if got := after.Registrations.Total - before.Registrations.Total; got != pools {
		t.Errorf("daemon saw %d registrations for %d pools", got, pools)
	}
}

// testIoctlMetrics: the transfer counters show one copy per byte moved by
// the ioctls, and exactly the bytes moved.
func testIoctlMetrics(t *testing.T, d *daemon, dir string) {
	tmp := t.TempDir()
	local := filepath.Join(tmp, "local")
	const size = 8*miB + 123
	writeRandom(t, local, size, 8)
	key := filepath.Join(dir, "m")
	for _, c := range []struct {
		name          string
		args          []string
		written, read uint64
	}{
		{"put_vm", []string{"put", key, local}, size, 0},
		{"put_buf", []string{"put", "--buf", key, local}, size, 0},
		{"get_vm", []string{"get", key, filepath.Join(tmp, "o1")}, 0, size},
		{"get_buf", []string{"get", "--buf", key, filepath.Join(tmp, "o2")}, 0, size},
		{"get_part", []string{"get", "--off", "1000", "--len", "5000", key, filepath.Join(tmp, "o3")}, 0, 5000},
		{"batch", []string{"batch-put", dir, "x1", "x2"}, uint64(keyValueLen("x1") + keyValueLen("x2")), 0},
	} {
		s0 := d.ioStatus(t)
		_, m := client(t, c.args...)
		for name, s := range m {
			if !s.OK {
				t.Fatalf("%s: %s: %s (%s)", c.name, name, s.Errno, s.Detail)
			}
		}
		s1 := d.ioStatus(t)
		w := s1.Transfer.BytesWritten - s0.Transfer.BytesWritten
		r := s1.Transfer.BytesRead - s0.Transfer.BytesRead
		cp := s1.Transfer.CopiedBytes - s0.Transfer.CopiedBytes
		if w != c.written || r != c.read || cp != c.written+c.read {
			t.Errorf("%s: written %d, read %d, copied %d; want %d, %d and one copy per byte (%d)",
				c.name, w, r, cp, c.written, c.read, c.written+c.read)
		}
	}
}

// keyValueLen is the length of ioctlclient's value for a batch key:
// sha256(key) repeated 1+3*len(key) times.
func keyValueLen(key string) int { return 32 * (1 + 3*len(key)) }

// testIoctlBadInput: refused calls answer the right errno and leave the
// committed value as it was.
func testIoctlBadInput(t *testing.T, d *daemon, dir string) {
	list, m := client(t, "badinput", dir)
	for name, errno := range map[string]string{
		"foreign_id":            "EINVAL",
		"foreign_id_get":        "EINVAL",
		"unknown_id":            "EINVAL",
		"past_buffer":           "EFAULT",
		"past_buffer_get":       "EFAULT",
		"offset_overflow":       "EFAULT",
		"bad_flags":             "EINVAL",
		"bad_flags_vm":          "EINVAL",
		"get_flags":             "EINVAL",
		"objoff_without_update": "EINVAL",
		"bad_address":           "EFAULT",
		"get_bad_address":       "EFAULT",
		"get_past_end":          "ERANGE",
		"register_bad_fd":       "EINVAL",
		"register_closed_fd":    "EBADF",
		"register_zero_len":     "EINVAL",
		"register_past_file":    "EINVAL",
		"register_unaligned":    "EINVAL",
		"register_not_memfd":    "EINVAL",
		"put_readonly":          "EBADF",
		"register_readonly":     "OK",
		"put_buf_readonly":      "EBADF",
		"put_on_dir":            "EISDIR",
		"batch_on_file":         "ENOTDIR",
		"batch_foreign_id":      "EINVAL",
		"batch_excl_existing":   "EEXIST",
		"batch_dotdot":          "EINVAL",
		"batch_absolute":        "EINVAL",
		"excl_nonempty":         "EEXIST",
		"still_works":           "OK",
	} {
		want(t, m, name, errno)
	}
	unchanged := 0
	for _, s := range list {
		if strings.HasPrefix(s.Step, "unchanged:") {
			unchanged++
			if !s.OK {
				t.Errorf("%s: %s (%s)", s.Step, s.Errno, s.Detail)
			}
		}
	}
	if unchanged < 25 {
		t.Errorf("%d unchanged checks, want one after each bad call", unchanged)
	}
}

// TestIoctlShrunkBuffer: a client that shrinks a registered memfd under
// the daemon gets an error; the daemon lives on.
func TestIoctlShrunkBuffer(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB", "--evict", "off")
	dir := d.path("shrink")
	run(t, "mkdir", dir)
	out, err := runErr(ioctlClientBin(t), "shrink", dir)
	if d.exited() {
		t.Fatalf("daemon died when a client shrank its registered buffer: %v\n%s", d.err, out)
	}
	if err != nil {
		t.Fatalf("ioctlclient shrink: %v\n%s", err, out)
	}
	_, m := steps(t, out)
	for _, name := range []string{"put_shrunk", "get_shrunk"} {
		if s := m[name]; s.OK || s.Errno == "" {
			t.Errorf("%s: %s, want an error (EFAULT)", name, orOK(s))
		}
	}
	d.checkAlive(t)
}

// TestIoctlMappedMemory: puts and gets of process memory that is a
// MAP_SHARED mapping of a file of the same mount, by one key and by
// batch, clean and dirty, large and small. The daemon's copy faults on
// pages it must serve itself; the large copies once ran on the engine's
// shared workers, which the faults' own requests needed, and the first
// such get hung the mount for good. Each case's files are checked
// against a model once the mapping is written back.
func TestIoctlMappedMemory(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "512MiB", "--evict", "off")
	dir := d.path("mapped")
	run(t, "mkdir", dir)
	out, err := runErr(ioctlClientBin(t), "mapped", dir)
	if err != nil {
		t.Fatalf("ioctlclient mapped: %v\n%s", err, out)
	}
	list, _ := steps(t, out)
	if len(list) != 32 {
		t.Errorf("%d steps, want 32:\n%s", len(list), out)
	}
	for _, s := range list {
		if !s.OK {
			t.Errorf("%s: %s (%s)", s.Step, s.Errno, s.Detail)
		}
	}
	d.checkAlive(t)
}

// TestIoctlMappedUpdate: updates through an open file from a mapping of
// that same file, while another thread fsyncs and truncates it. The
// update writes into the file's draft; the mapping's faults come back as
// READs of it, and the fsyncs commit it. The copy once held the draft
// while it faulted: a commit queued behind it, the READs behind the
// commit, and the mount hung for good.
func TestIoctlMappedUpdate(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "512MiB", "--evict", "off")
	dir := d.path("update")
	run(t, "mkdir", dir)
	c := background(t, ioctlClientBin(t), "mapped-update", dir)
	select {
	case <-c.done:
	case <-time.After(cmdTimeout / 2):
		// A deadline for a hang, not a speed: its client cannot be
		// killed while the daemon holds its request.
		d.kill9(t)
		<-c.done
		t.Fatalf("the update did not end; daemon killed:\n%s", c.out.String())
	}
	_, m := steps(t, c.mustWait(t))
	want(t, m, "update_from_own_mapping", "OK")
	d.checkAlive(t)
}

// TestIoctlPutThenStat: a put by name (PUT_KEY, BATCH_PUTV) that grows a
// key the kernel has cached is seen whole by the caller's next stat. The
// kernel's copy was once forgotten only after the reply: a fifth of the
// stats saw the old size, and a get into a mapping of the key right after
// its put lost pages to the late invalidation.
func TestIoctlPutThenStat(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "256MiB", "--evict", "off")
	dir := d.path("pts")
	run(t, "mkdir", dir)
	_, m := client(t, "put-then-stat", dir)
	want(t, m, "put_key_then_stat", "OK")
	want(t, m, "batch_put_then_stat", "OK")
	want(t, m, "file_put_then_stat", "OK")
	d.checkAlive(t)
}
