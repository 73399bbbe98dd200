package tests

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestDaemonCPUs mounts with --cpus 0: every thread of the daemon, those
// started before the flag took effect included, runs on CPU 0 only, status
// says so, and the mount serves as usual. A --cpus the daemon may not use
// stops it before it mounts, with an error that names the flag.
func TestDaemonCPUs(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB", "--cpus", "0")
	pid := d.cmd.Process.Pid
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		t.Fatal(err)
	}
	if len(tasks) < 2 {
		t.Fatalf("daemon has %d threads", len(tasks))
	}
	for _, task := range tasks {
		b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "task", task.Name(), "status"))
		if err != nil {
			continue // the thread exited
		}
		for line := range strings.SplitSeq(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok && strings.TrimSpace(v) != "0" {
				t.Errorf("thread %s of the daemon may run on CPUs %s, want 0", task.Name(), strings.TrimSpace(v))
			}
		}
	}
	var st struct {
		Affinity string `json:"cpu_affinity"`
	}
	out := run(t, daemonBin(), "status", "--json", d.dir)
	if err := json.Unmarshal([]byte(out), &st); err != nil || st.Affinity != "0" {
		t.Errorf("status cpu_affinity = %q (%v), want \"0\"", st.Affinity, err)
	}
	src := filepath.Join(t.TempDir(), "src")
	writeRandom(t, src, 8*miB, 3)
	run(t, "cp", src, d.path("f"))
	run(t, "cmp", src, d.path("f"))

	dir := newMountpoint(t)
	for _, bad := range []string{"65000", "1-0", "zero"} {
		out, err := runErr(daemonBin(), "mount", "--size", "16MiB", "--cpus", bad, dir)
		if err == nil || !strings.Contains(out, "--cpus") {
			t.Errorf("mount --cpus %s: %v, output %q; want a failure naming --cpus", bad, err, out)
		}
		if mounted(dir) {
			t.Fatalf("mount --cpus %s left %s mounted", bad, dir)
		}
	}
}
