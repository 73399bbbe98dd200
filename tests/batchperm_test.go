package tests

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestBatchPermissions: batch ioctls reach keys the kernel never checked,
// so the daemon applies the mode bits itself. nobody may read a 0644 file
// and its own files, but not a 0600 root file, and may not write into a
// root-owned 0755 directory; nothing it was refused changes.
func TestBatchPermissions(t *testing.T) {
	t.Parallel()
	requireTools(t, python, "setpriv")
	d := startDaemon(t, "--size", "64MiB")
	pub := d.publicDir(t)
	run(t, "sh", "-c", `printf secret > "$1/secret" && chmod 600 "$1/secret" && printf open > "$1/open" && chmod 644 "$1/open"`, "sh", pub)
	run(t, "mkdir", "-m", "0755", d.path("rootdir"))
	script := `
import errno, sys
sys.path.insert(0, sys.argv[1])
import mooncake_fs as mc
c = mc.Client(sys.argv[2])
out = {}
r = c.batch_get_into({"secret": bytearray(16), "open": bytearray(16)}, dir="pub", check=False)
out["get_secret"] = r["secret"]; out["get_open"] = r["open"]
r = c.batch_put({"mine": b"ok"}, dir="pub", check=False, makedirs=False)
out["put_mine"] = r["mine"]
r = c.batch_put({"secret": b"overwritten"}, dir="pub", check=False, makedirs=False)
out["put_secret"] = r["secret"]
r = c.batch_put({"x": b"no"}, dir="rootdir", check=False, makedirs=False)
out["put_rootdir"] = r["x"]
for k, v in sorted(out.items()):
    print(f"{k}={v}")
`
	out, err := asNobody(`exec "$1" -c "$2" "$3" "$4"`, python, script, publicPythonDir(t), d.dir)
	if err != nil {
		t.Fatalf("nobody's batch script: %v\n%s", err, out)
	}
	got := pyResults(out)
	want := map[string]string{
		"get_secret": "-13", "get_open": "4", "put_mine": "2", "put_secret": "-13", "put_rootdir": "-13",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q\n%s", k, got[k], v, out)
		}
	}
	if b := run(t, "cat", filepath.Join(pub, "secret")); strings.TrimSpace(b) != "secret" {
		t.Errorf("refused put changed the file: %q", b)
	}
	if _, err := os.Stat(filepath.Join(d.dir, "rootdir", "x")); err == nil {
		t.Errorf("refused put created a key")
	}
	d.checkAlive(t)
}
