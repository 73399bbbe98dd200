package segment

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
)

// The data-driven tests read files of cases like
//
//	# comment
//	alloc 8K
//	----
//	[0+8192)
//
// A case is one command line, a "----" line, and the expected output up to
// the next blank line or the end of the file. Sizes take an optional K, M or
// G suffix (powers of 1024). Run with -rewrite to regenerate the expected
// output in place after an intended change, then review the diff.

var rewrite = flag.Bool("rewrite", false, "rewrite testdata files with the actual output")

type ddCase struct {
	pre  []string // comment and blank lines before the command
	line int      // line number of the command, 1-based
	cmd  string
	want string
}

func parseDataDriven(t *testing.T, path string) (cases []ddCase, trailer []string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	var pre []string
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if strings.TrimSpace(l) == "" || strings.HasPrefix(l, "#") {
			pre = append(pre, l)
			continue
		}
		c := ddCase{pre: pre, line: i + 1, cmd: strings.TrimSpace(l)}
		pre = nil
		i++
		if i >= len(lines) || lines[i] != "----" {
			t.Fatalf("%s:%d: want ---- after command %q", path, c.line, c.cmd)
		}
		var out []string
		for i+1 < len(lines) && strings.TrimSpace(lines[i+1]) != "" {
			i++
			out = append(out, lines[i])
		}
		c.want = strings.Join(out, "\n")
		cases = append(cases, c)
	}
	return cases, pre
}

// runDataDriven runs every case in path through run, which returns the
// output for one command (no blank lines), and compares it with the file.
func runDataDriven(t *testing.T, path string, run func(t *testing.T, cmd string, args []string) string) {
	t.Helper()
	cases, trailer := parseDataDriven(t, path)
	var b strings.Builder
	for _, c := range cases {
		f := strings.Fields(c.cmd)
		got := strings.TrimRight(run(t, f[0], f[1:]), "\n")
		if strings.Contains(got, "\n\n") {
			t.Fatalf("%s:%d: %s: output has a blank line:\n%s", path, c.line, c.cmd, got)
		}
		if !*rewrite && got != c.want {
			t.Errorf("%s:%d: %s\ngot:\n%s\nwant:\n%s", path, c.line, c.cmd, got, c.want)
		}
		for _, l := range c.pre {
			b.WriteString(l + "\n")
		}
		b.WriteString(c.cmd + "\n----\n")
		if got != "" {
			b.WriteString(got + "\n")
		}
	}
	for _, l := range trailer {
		b.WriteString(l + "\n")
	}
	if *rewrite {
		if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// parseSize parses a byte count with an optional K, M or G suffix.
func parseSize(t *testing.T, s string) uint64 {
	t.Helper()
	mult := uint64(1)
	switch {
	case strings.HasSuffix(s, "K"):
		mult, s = 1<<10, strings.TrimSuffix(s, "K")
	case strings.HasSuffix(s, "M"):
		mult, s = 1<<20, strings.TrimSuffix(s, "M")
	case strings.HasSuffix(s, "G"):
		mult, s = 1<<30, strings.TrimSuffix(s, "G")
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		t.Fatalf("bad size %q: %v", s, err)
	}
	return n * mult
}

// parseExtent parses the form Extent.String prints: seg1[0+4096).
func parseExtent(t *testing.T, s string) Extent {
	t.Helper()
	var e Extent
	var tail string
	if _, err := fmt.Sscanf(s, "seg%d[%d+%d%s", &e.Segment, &e.Off, &e.Len, &tail); err != nil || tail != ")" {
		t.Fatalf("bad extent %q (want seg1[0+4096))", s)
	}
	return e
}

func wantArgs(t *testing.T, cmd string, args []string, n int) {
	t.Helper()
	if len(args) != n {
		t.Fatalf("%s: want %d arguments, got %q", cmd, n, args)
	}
}

func fmtStats(s Stats) string {
	return fmt.Sprintf("size=%d used=%d free=%d largest=%d ranges=%d frag=%.3f",
		s.Size, s.Used, s.Free, s.LargestFree, s.FreeRanges, s.Fragmentation)
}

func fmtRanges(rs []Range) string {
	if len(rs) == 0 {
		return "none"
	}
	s := make([]string, len(rs))
	for i, r := range rs {
		s[i] = r.String()
	}
	return strings.Join(s, " ")
}

func fmtExtents(es []Extent) string {
	if len(es) == 0 {
		return "none"
	}
	s := make([]string, len(es))
	for i, e := range es {
		s[i] = e.String()
	}
	return strings.Join(s, " ")
}

func errOr(err error, ok string) string {
	if err != nil {
		return "error: " + err.Error()
	}
	return ok
}

// TestAllocatorDataDriven runs testdata/allocator. Commands:
//
//	new SIZE             replace the allocator
//	alloc N              Alloc; prints the ranges
//	alloc-contig N       AllocContiguous; prints the range
//	free OFF LEN         Free
//	free-ranges          the free ranges by offset
//	stats                Stats
//
// Every command is followed by Check.
func TestAllocatorDataDriven(t *testing.T) {
	var a *Allocator
	runDataDriven(t, "testdata/allocator", func(t *testing.T, cmd string, args []string) (out string) {
		if cmd != "new" && a == nil {
			t.Fatalf("%s before new", cmd)
		}
		defer func() {
			if err := a.Check(); err != nil {
				t.Fatalf("after %s %v: %v", cmd, args, err)
			}
		}()
		switch cmd {
		case "new":
			wantArgs(t, cmd, args, 1)
			a = NewAllocator(parseSize(t, args[0]))
			return fmtStats(a.Stats())
		case "alloc":
			wantArgs(t, cmd, args, 1)
			rs, err := a.Alloc(parseSize(t, args[0]))
			return errOr(err, fmtRanges(rs))
		case "alloc-contig":
			wantArgs(t, cmd, args, 1)
			r, err := a.AllocContiguous(parseSize(t, args[0]))
			return errOr(err, r.String())
		case "free":
			wantArgs(t, cmd, args, 2)
			return errOr(a.Free(Range{Off: parseSize(t, args[0]), Len: parseSize(t, args[1])}), "ok")
		case "free-ranges":
			return fmtRanges(a.FreeRanges())
		case "stats":
			return fmtStats(a.Stats())
		}
		t.Fatalf("unknown command %q", cmd)
		return ""
	})
}

// TestTableDataDriven runs testdata/table. Commands:
//
//	new                  replace the table with an empty one
//	segment ID SIZE      Add a segment over SIZE fresh bytes
//	alloc N              Alloc; prints the extents
//	free EXTENT...       Free (extents as seg1[0+4096))
//	bytes EXTENT         Bytes; prints len and cap
//	free-ranges          each segment's free ranges
//	stats                Stats
func TestTableDataDriven(t *testing.T) {
	var tb *Table
	runDataDriven(t, "testdata/table", func(t *testing.T, cmd string, args []string) string {
		if cmd != "new" && tb == nil {
			t.Fatalf("%s before new", cmd)
		}
		defer func() {
			for _, s := range tb.Segments() {
				if err := s.Alloc.Check(); err != nil {
					t.Fatalf("after %s %v: seg%d: %v", cmd, args, s.ID, err)
				}
			}
		}()
		switch cmd {
		case "new":
			tb = NewTable()
			return "ok"
		case "segment":
			wantArgs(t, cmd, args, 2)
			id, err := strconv.ParseUint(args[0], 10, 32)
			if err != nil {
				t.Fatal(err)
			}
			return errOr(tb.Add(NewSegment(ID(id), make([]byte, parseSize(t, args[1])))), "ok")
		case "alloc":
			wantArgs(t, cmd, args, 1)
			es, err := tb.Alloc(parseSize(t, args[0]))
			return errOr(err, fmtExtents(es))
		case "free":
			es := make([]Extent, len(args))
			for i, s := range args {
				es[i] = parseExtent(t, s)
			}
			return errOr(tb.Free(es), "ok")
		case "bytes":
			wantArgs(t, cmd, args, 1)
			b, err := tb.Bytes(parseExtent(t, args[0]))
			return errOr(err, fmt.Sprintf("len=%d cap=%d", len(b), cap(b)))
		case "free-ranges":
			var lines []string
			for _, s := range tb.Segments() {
				lines = append(lines, fmt.Sprintf("seg%d: %s", s.ID, fmtRanges(s.Alloc.FreeRanges())))
			}
			return strings.Join(lines, "\n")
		case "stats":
			return fmtStats(tb.Stats())
		}
		t.Fatalf("unknown command %q", cmd)
		return ""
	})
}
