package tests

import (
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/mooncake-fs/mooncake-fs/"

// rank orders the layers: a package may import only packages of a higher
// rank (further down). ioctl is a leaf that anyone may import and that
// imports none of ours.
var rank = map[string]int{
	"cmd/mooncake-fs": 0,
	"fs":              1,
	"store":           2,
	"transfer":        3,
	"segment":         4,
	"pinned":          5,
	"cuda":            6,
	"rdma":            6,
	"ioctl":           7,
}

// TestLayering fails on any import edge not in the layer picture of
// DESIGN.md, the way pebble keeps its lint rules as tests.
func TestLayering(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, "../...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for line := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		from, ok := strings.CutPrefix(f[0], module)
		if !ok || strings.HasPrefix(from, "tests") {
			continue
		}
		top := layer(from)
		rf, known := rank[top]
		if !known {
			t.Errorf("package %s is not in the layer table: add it to DESIGN.md's picture and to rank", from)
			continue
		}
		for _, imp := range f[1:] {
			to, ok := strings.CutPrefix(imp, module)
			if !ok {
				continue
			}
			tl := layer(to)
			if tl == top {
				continue
			}
			rt, known := rank[tl]
			if !known {
				t.Errorf("%s imports unknown layer %s", from, to)
				continue
			}
			if rt <= rf {
				t.Errorf("%s imports %s: arrows must point down (cmd -> fs -> store -> {transfer, segment} -> pinned -> {cuda, rdma}; ioctl is a leaf)", from, to)
			}
		}
	}
}

// layer returns the top-level package a path belongs to (subpackages such
// as store/indextest belong to store).
func layer(p string) string {
	if strings.HasPrefix(p, "cmd/") {
		return p
	}
	top, _, _ := strings.Cut(p, "/")
	return top
}
