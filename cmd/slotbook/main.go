// Command slotbook is an operator's view of slotbook's quotas in Redis: it
// reads subjects' state without spending quota, and clears a subject.
//
//	slotbook [flags] inspect NAME [SUBJECT...]   subjects of limiter NAME, most backed up first
//	slotbook [flags] watch NAME                  the same, refreshed every -interval
//	slotbook [flags] reset NAME SUBJECT          clear a subject in every limit
//
// Flags go before the command: after it, an argument that names a flag
// is a usage error; "--" before a subject that looks like one ("inspect
// api -- -json") takes it as it is.
//
// For each subject it shows how far ahead slots are booked (BACKLOG, until
// the stored TAT), each key's time to live, and, given the limits with
// -limit, the wait a request made now would get and its slot (WAIT, NEXT
// FREE, on the Redis clock; with its date when a day or more away).
// Without -limit the wait is unknown: it depends on the burst. Keys are
// found with SCAN (never KEYS), on every master of a Redis Cluster
// (detected from the server). -json prints JSON
// (one object per frame for watch); a subject that is not valid UTF-8,
// which a JSON string cannot carry, has its exact bytes in base64 as well
// ("subject_base64", and "key_base64" for its keys), and so has a limiter
// name ("name_base64"); reset -json gives "reset_base64" when a key it
// cleared is not valid UTF-8.
//
// A subject's keys are read as the library reads them. A key left from
// wire protocol version 1 (a further limit's key named after a Go
// duration, ":24h0m0s", where version 2 writes ":86400000ms") is listed,
// marked "protocol 1 key: not read" ("not_read" and "protocol1": true in
// JSON), but counts in none of the subject's figures: the library does not
// read it (docs/PROTOCOL.md, "Upgrading from version 1"). reset deletes it
// too. Given -limit, a key of a period none of them has (left by an
// earlier configuration, until it expires) is listed the same way, marked
// "no such -limit: not read" ("not_read": true).
//
// A subject whose key holds a value that is not a TAT (corrupt, or of
// another Redis type: WRONGTYPE; reset clears it) is listed first, as
// unreadable, with the reason ("error" in JSON), and the others as usual;
// inspect then fails (exit code 1) after printing, while watch goes on.
//
// watch also outlives a reading that fails (Redis away, or slower than
// -timeout, for a while): that frame is its error alone ("reading
// failed", or {"name", "at", "error"} in JSON), and the next reading comes
// at the next interval. It ends when interrupted, or after -count frames
// (a failed one counts), exiting 1 if the last one failed.
//
//	go run ./cmd/slotbook -redis redis://127.0.0.1:6379/0 inspect partner-api
//	go run ./cmd/slotbook -limit 10/1s:5 -limit 10000/24h inspect stripe tenant-42
//	go run ./cmd/slotbook -interval 2s watch stripe
//	go run ./cmd/slotbook reset stripe tenant-42
package main

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/rediserr"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "slotbook:", err)
		if errors.Is(err, errUsage) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}

// errUsage is matched by errors in the command line.
var errUsage = errors.New("usage")

type config struct {
	url      string
	prefix   string
	asJSON   bool
	top      int
	interval time.Duration
	count    int
	timeout  time.Duration
	limits   limitFlags
}

func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("slotbook", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var c config
	fs.StringVar(&c.url, "redis", "redis://127.0.0.1:6379/0", "Redis URL (a Cluster is detected: give any node)")
	fs.StringVar(&c.prefix, "prefix", throttle.DefaultPrefix, "key prefix (throttle.WithPrefix)")
	fs.BoolVar(&c.asJSON, "json", false, "print JSON")
	fs.IntVar(&c.top, "top", 20, "inspect and watch: show the N most backed-up subjects (0: all)")
	fs.DurationVar(&c.interval, "interval", time.Second, "watch: time between refreshes")
	fs.IntVar(&c.count, "count", 0, "watch: stop after N refreshes (0: until interrupted)")
	fs.DurationVar(&c.timeout, "timeout", 2*time.Second, "bound on each Redis call")
	fs.Var(&c.limits, "limit", "a limit of NAME, RATE/PERIOD[:BURST] (10/1s:5), to show waits and next free slots; "+
		"repeat it for every limit, the first one first (no two of one period)")
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	cmd, rest := fs.Arg(0), fs.Args()[min(1, fs.NArg()):]
	// Flags go before the command: one after it ("inspect api -json") is a
	// mistake, not a subject. "--" lets later arguments that look like
	// flags through as they are.
	for i, a := range rest {
		if a == "--" {
			rest = slices.Delete(slices.Clone(rest), i, i+1)
			break
		}
		if n := flagName(a); n != "" && fs.Lookup(n) != nil {
			return fmt.Errorf("%w: flag %s after the command: flags go before it (\"--\" first for a subject that looks like a flag)", errUsage, a)
		}
	}
	switch {
	case cmd == "inspect" && len(rest) >= 1,
		cmd == "watch" && len(rest) == 1,
		cmd == "reset" && len(rest) == 2:
	default:
		return fmt.Errorf("%w: slotbook [flags] inspect NAME [SUBJECT...] | watch NAME | reset NAME SUBJECT", errUsage)
	}
	name := rest[0]
	if c.top < 0 || c.count < 0 || c.interval <= 0 || c.timeout <= 0 {
		return fmt.Errorf("%w: -top and -count must not be negative, -interval and -timeout must be positive", errUsage)
	}
	opts, err := redis.ParseURL(c.url)
	if err != nil {
		return fmt.Errorf("%w: -redis: %w", errUsage, err)
	}
	// -timeout bounds each call as a whole (retries, a dial and its
	// handshake included) through the call's context (db.call); the
	// client's own timeouts bound each step of what runs without one (a
	// Cluster client's background refresh of its slots).
	opts.ContextTimeoutEnabled = true
	opts.DialTimeout, opts.ReadTimeout, opts.WriteTimeout = c.timeout, c.timeout, c.timeout
	db := &db{client: redis.NewClient(opts), timeout: c.timeout} // it connects at its first call
	defer db.Close()
	// Everything on the command line is checked by the library's own
	// rules (package reserve's, for the name, the limits and the
	// subjects) before any connection is made.
	v, err := newViewer(db, c, name)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	for _, s := range rest[1:] {
		if err := v.lim.CheckKey(s); err != nil {
			return fmt.Errorf("%w: subject %q: %w", errUsage, s, err)
		}
	}

	if err := db.connect(ctx, opts); err != nil {
		return err
	}
	if db.cluster != nil { // the engine and limiter anew, over the Cluster client
		if v, err = newViewer(db, c, name); err != nil {
			return err
		}
	}
	switch cmd {
	case "inspect":
		subjects, err := v.read(ctx, rest[1:])
		if err != nil {
			return err
		}
		if err := v.print(out, subjects); err != nil {
			return err
		}
		return unreadable(subjects)
	case "watch":
		return v.watch(ctx, out)
	default:
		return v.reset(ctx, out, rest[1])
	}
}

// flagName returns the name of the flag a would set ("-json", "--top=3"),
// or "" if a does not look like a flag.
func flagName(a string) string {
	n, ok := strings.CutPrefix(a, "-")
	if !ok {
		return ""
	}
	n = strings.TrimPrefix(n, "-")
	n, _, _ = strings.Cut(n, "=")
	return n
}

// db is a connection to a Redis server or Cluster.
type db struct {
	client  redis.UniversalClient
	cluster *redis.ClusterClient // nil for a single server
	timeout time.Duration        // -timeout, the bound on each call
}

func (d *db) Close() error { return d.client.Close() }

// call returns ctx bounded by -timeout, for one Redis call.
func (d *db) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d.timeout)
}

// connect asks the server opts names whether it is a Cluster node, and if
// so replaces d's client by a Cluster client.
func (d *db) connect(ctx context.Context, opts *redis.Options) error {
	cctx, cancel := d.call(ctx)
	info, err := d.client.Info(cctx, "cluster").Result()
	cancel()
	if err != nil {
		return fmt.Errorf("redis %s: %w", opts.Addr, err)
	}
	if !strings.Contains(info, "cluster_enabled:1") {
		return nil
	}
	_ = d.client.Close()
	cc := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs: []string{opts.Addr}, Username: opts.Username, Password: opts.Password,
		TLSConfig: opts.TLSConfig, ContextTimeoutEnabled: true,
		DialTimeout: opts.DialTimeout, ReadTimeout: opts.ReadTimeout, WriteTimeout: opts.WriteTimeout,
	})
	d.client, d.cluster = cc, cc
	return nil
}

// scan returns every key matching pattern, on every master of a Cluster.
// Each SCAN call (and a Cluster's reading of its masters) is one call,
// bounded by -timeout.
func (d *db) scan(ctx context.Context, pattern string) ([]string, error) {
	masters := []*redis.Client{}
	if d.cluster != nil {
		var mu sync.Mutex // guards masters
		cctx, cancel := d.call(ctx)
		err := d.cluster.ForEachMaster(cctx, func(_ context.Context, c *redis.Client) error {
			mu.Lock()
			masters = append(masters, c)
			mu.Unlock()
			return nil
		})
		cancel()
		if err != nil {
			return nil, fmt.Errorf("scan %q: %w", pattern, err)
		}
	} else {
		masters = append(masters, d.client.(*redis.Client))
	}
	found := make([][]string, len(masters))
	errs := make([]error, len(masters))
	var wg sync.WaitGroup
	for i, c := range masters {
		wg.Go(func() {
			var cursor uint64
			for {
				cctx, cancel := d.call(ctx)
				page, next, err := c.Scan(cctx, cursor, pattern, 1000).Result()
				cancel()
				if err != nil {
					errs[i] = err
					return
				}
				found[i] = append(found[i], page...)
				if cursor = next; cursor == 0 {
					return
				}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("scan %q: %w", pattern, err)
	}
	keys := slices.Concat(found...)
	slices.Sort(keys)
	return slices.Compact(keys), nil
}

type viewer struct {
	db   *db
	eng  *throttle.Engine
	c    config
	name string
	// lim is limiter name as the -limit flags describe it. Without them
	// its limit is a stand-in: it then serves only for reserve's checks
	// of the subjects.
	lim *reserve.Limiter
}

// newViewer builds the engine and limiter over db's client; it makes no
// network call. Its errors are the command line's: the name or a limit.
func newViewer(db *db, c config, name string) (*viewer, error) {
	eng, err := throttle.New(db.client, throttle.WithPrefix(c.prefix), throttle.WithTimeout(c.timeout))
	if err != nil {
		return nil, err
	}
	first, more := throttle.Every(time.Second, 1, 0), []throttle.Limit(nil)
	if len(c.limits) > 0 {
		first, more = c.limits[0], c.limits[1:]
	}
	lim, err := reserve.New(eng, name, first, reserve.WithLimit(more...))
	if err != nil {
		return nil, err
	}
	return &viewer{db: db, eng: eng, c: c, name: name, lim: lim}, nil
}

// subject is one subject's reading, as printed.
type subject struct {
	Subject string `json:"subject"`
	// SubjectBase64 holds the subject's exact bytes (standard base64) when
	// they are not valid UTF-8, which a JSON string cannot carry: Subject
	// then has U+FFFD in place of each invalid byte. The same holds for a
	// key's KeyBase64.
	SubjectBase64 string    `json:"subject_base64,omitempty"`
	Backlog       duration  `json:"backlog"`
	Wait          *duration `json:"wait,omitempty"`      // with -limit
	NextFree      time.Time `json:"next_free,omitzero"`  // with -limit
	Available     *int      `json:"available,omitempty"` // with -limit
	Keys          []key     `json:"keys"`
	// Error is why the subject could not be read (a corrupt value, which
	// reset clears); the reading then has no figures and no keys.
	Error   string `json:"error,omitempty"`
	backlog time.Duration
	now     time.Time // of the reading, on the Redis clock
	err     error
}

// unreadable returns an error naming the subjects that could not be read,
// if any: after the listing of the others, the command fails (exit code 1).
func unreadable(subjects []subject) error {
	var bad []string
	hint := "" // reset is suggested only for a value that is not a TAT
	for _, s := range subjects {
		if s.err != nil {
			bad = append(bad, strconv.Quote(s.Subject))
			if corrupt(s.err) {
				hint = "; reset clears a corrupt subject"
			}
		}
	}
	if len(bad) == 0 {
		return nil
	}
	n := len(bad)
	if n > 5 {
		bad = append(bad[:5], "...")
	}
	return fmt.Errorf("%d of %d subjects unreadable (%s)%s",
		n, len(subjects), strings.Join(bad, ", "), hint)
}

type key struct {
	Key       string   `json:"key"`
	KeyBase64 string   `json:"key_base64,omitempty"` // see subject.SubjectBase64
	Period    duration `json:"period,omitempty"`     // 0: the first limit
	// NotRead marks a key the library does not read, which therefore
	// counts in none of the subject's figures: one of protocol version 1
	// (Protocol1), or, given -limit, a live key of a period that is none
	// of theirs (left by an earlier configuration of the limiter).
	NotRead bool `json:"not_read,omitempty"`
	// Protocol1 marks a key of wire protocol version 1's layout (a Go
	// duration after the subject, ":24h0m0s"), left from before an upgrade:
	// the library neither reads nor writes it (docs/PROTOCOL.md,
	// "Upgrading from version 1").
	Protocol1 bool      `json:"protocol1,omitempty"`
	Exists    bool      `json:"exists"`
	TAT       time.Time `json:"tat,omitzero"`
	Backlog   duration  `json:"backlog"`
	TTL       duration  `json:"ttl"` // negative: no expiry
}

// exact returns s in base64 if it is not valid UTF-8 (which JSON cannot
// carry), else "".
func exact(s string) string {
	if utf8.ValidString(s) {
		return ""
	}
	return base64.StdEncoding.EncodeToString([]byte(s))
}

// duration prints as Go's Duration string in text and as seconds in JSON.
type duration time.Duration

func (d duration) String() string { return time.Duration(d).Round(time.Millisecond).String() }

func (d duration) MarshalJSON() ([]byte, error) {
	return strconv.AppendFloat(nil, time.Duration(d).Seconds(), 'f', -1, 64), nil
}

// read reads the given subjects of v's limiter, or every one found.
func (v *viewer) read(ctx context.Context, only []string) ([]subject, error) {
	found := map[string]*subjectKeys{}
	patterns := []string{subjectPattern(v.c.prefix, v.name, "")}
	if len(only) > 0 {
		patterns = patterns[:0]
		for _, s := range only { // checked by run
			if found[s] != nil {
				continue // named twice
			}
			found[s] = newSubjectKeys()
			patterns = append(patterns, subjectPattern(v.c.prefix, v.name, s))
		}
	}
	for _, p := range patterns {
		keys, err := v.db.scan(ctx, p)
		if err != nil {
			return nil, err
		}
		for _, full := range keys {
			s, period, v1, ok := parseKey(full, v.c.prefix, v.name)
			if !ok || (len(only) > 0 && found[s] == nil) {
				continue // a tombstone, or another subject matching the pattern
			}
			if found[s] == nil {
				found[s] = newSubjectKeys()
			}
			// A key is found once per pattern that matches it: named
			// subjects' patterns overlap ("a" matches the keys of "a}").
			k := strings.TrimPrefix(full, v.c.prefix)
			if v1 {
				found[s].v1[k] = struct{}{}
			} else {
				found[s].live[period] = k
			}
		}
	}
	out := make([]subject, 0, len(found))
	for s, keys := range found {
		sub, err := v.state(ctx, s, keys)
		if err != nil {
			// A value that is no TAT (a corrupt one, or a key of another
			// Redis type), or a key the engine refuses, is this subject's
			// trouble alone: it is reported in its place, and the others are
			// listed. Anything else (Redis away) ends the reading.
			if !subjectError(err) {
				return nil, err
			}
			sub = subject{Subject: s, SubjectBase64: exact(s), Error: err.Error(), Keys: []key{}, err: err}
		}
		out = append(out, sub)
	}
	slices.SortFunc(out, func(a, b subject) int { // the unreadable first, then the most backed up
		if a.err != nil != (b.err != nil) {
			if a.err != nil {
				return -1
			}
			return 1
		}
		if c := cmp.Compare(b.backlog, a.backlog); c != 0 {
			return c
		}
		return strings.Compare(a.Subject, b.Subject)
	})
	return out, nil
}

// subjectError reports whether err, of reading one subject, is that
// subject's own: a value that is not a TAT (ErrCorruptState, or WRONGTYPE
// for a key holding a list, a hash...; reset clears both), or a key the
// engine refuses.
func subjectError(err error) bool {
	return corrupt(err) || errors.Is(err, throttle.ErrInvalidRequest)
}

// corrupt reports whether err is of a key whose value is not a TAT
// (ErrCorruptState, WRONGTYPE): the case reset is the way out of.
func corrupt(err error) bool {
	return errors.Is(err, throttle.ErrCorruptState) || rediserr.WrongType(err)
}

// subjectKeys are the keys found of one subject (before the prefix), each
// once.
type subjectKeys struct {
	live map[time.Duration]string // by period (0: the first limit's key)
	v1   map[string]struct{}      // of protocol version 1's layout, not read by the library
}

func newSubjectKeys() *subjectKeys {
	return &subjectKeys{live: map[time.Duration]string{}, v1: map[string]struct{}{}}
}

// state reads one subject's keys as the library reads them. Given the
// limits, that is exactly every limit's key, found or not: an absent key
// is an idle limit, whose burst still caps what is available (as
// Limiter.State); a live key found of another period (left by an earlier
// configuration) is read apart and shown, but counts in none of the
// subject's figures. Without them, it is the first limit's key, found or
// not (the library always reads it), and every live key found, MaxLimits
// to a call: a subject may hold more than one limiter has (left by several
// configurations). Keys of protocol version 1's layout, which the library
// does not read, are read apart and shown, but count in none of the
// subject's figures.
func (v *viewer) state(ctx context.Context, s string, found *subjectKeys) (subject, error) {
	first := firstKey(v.name, s)
	byPeriod := map[time.Duration]string{0: first}
	var other []string // live keys of no given limit's period
	if len(v.c.limits) > 0 {
		for _, l := range v.c.limits[1:] {
			byPeriod[l.Period] = furtherKey(first, l.Period)
		}
		for p, k := range found.live {
			if _, ok := byPeriod[p]; !ok {
				other = append(other, k)
			}
		}
		slices.Sort(other)
	} else {
		maps.Copy(byPeriod, found.live)
	}
	periods := slices.Sorted(maps.Keys(byPeriod)) // the first limit's key (period 0) first
	keys := make([]string, len(periods))
	for i, p := range periods {
		keys[i] = byPeriod[p]
	}
	// Given the limits, there is one key per limit (at most MaxLimits):
	// one call, whose figures are the subject's (wait, available).
	// Without them, keys are read MaxLimits to a call, and the backlog is
	// the longest of them.
	limits := v.c.limits.match(periods)
	sub := subject{Subject: s, SubjectBase64: exact(s)}
	for i := 0; i < len(keys); i += throttle.MaxLimits {
		j := min(i+throttle.MaxLimits, len(keys))
		var ls []throttle.Limit
		if limits != nil {
			ls = limits[i:j]
		}
		cctx, cancel := v.db.call(ctx)
		st, err := v.eng.State(cctx, keys[i:j], ls)
		cancel()
		if err != nil {
			return subject{}, err
		}
		if i == 0 {
			sub.now = st.Now
			if limits != nil {
				w, a := duration(st.Wait), st.Available
				sub.Wait, sub.NextFree, sub.Available = &w, st.NextFree, &a
			}
		}
		sub.backlog = max(sub.backlog, st.Backlog)
		for n, k := range st.Keys {
			sub.Keys = append(sub.Keys, v.key(k, periods[i+n]))
		}
	}
	sub.Backlog = duration(sub.backlog)
	// Keys the library does not read: shown, in none of the figures.
	for _, apart := range []struct {
		keys      []string
		protocol1 bool
	}{{other, false}, {slices.Sorted(maps.Keys(found.v1)), true}} {
		for batch := range slices.Chunk(apart.keys, throttle.MaxLimits) {
			cctx, cancel := v.db.call(ctx)
			st, err := v.eng.State(cctx, batch, nil)
			cancel()
			if err != nil {
				return subject{}, err
			}
			for _, k := range st.Keys {
				_, period, _, _ := parseKey(v.c.prefix+k.Key, v.c.prefix, v.name)
				ks := v.key(k, period)
				ks.NotRead, ks.Protocol1 = true, apart.protocol1
				sub.Keys = append(sub.Keys, ks)
			}
		}
	}
	return sub, nil
}

// key returns a key's reading, as printed.
func (v *viewer) key(k throttle.KeyState, period time.Duration) key {
	full := v.c.prefix + k.Key
	return key{
		Key: full, KeyBase64: exact(full), Period: duration(period), Exists: k.Exists, TAT: k.TAT,
		Backlog: duration(k.Backlog), TTL: duration(k.TTL),
	}
}

// frame is one inspect or watch reading, as JSON.
type frame struct {
	Name       string    `json:"name"`
	NameBase64 string    `json:"name_base64,omitempty"` // see subject.SubjectBase64
	At         time.Time `json:"at"`
	Subjects   int       `json:"subjects"` // found, before -top
	Top        []subject `json:"top"`
}

func (v *viewer) print(out io.Writer, subjects []subject) error {
	f := frame{Name: v.name, NameBase64: exact(v.name), At: time.Now(), Subjects: len(subjects), Top: subjects}
	if v.c.top > 0 && len(subjects) > v.c.top {
		f.Top = subjects[:v.c.top]
	}
	if v.c.asJSON {
		return json.NewEncoder(out).Encode(f)
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "%s: %d subjects (%s)\n", v.name, f.Subjects, f.At.Format(time.RFC3339))
	fmt.Fprintln(tw, "SUBJECT\tBACKLOG\tWAIT\tNEXT FREE\tAVAILABLE\tKEY\tTTL")
	for _, s := range f.Top {
		if s.err != nil {
			fmt.Fprintf(tw, "%q\t?\t-\t-\t-\t(unreadable: see below)\t-\n", s.Subject)
			continue
		}
		wait, next, avail := "-", "-", "-"
		if s.Wait != nil {
			wait, next, avail = s.Wait.String(), s.NextFree.Format("15:04:05.000"), strconv.Itoa(*s.Available)
			if s.NextFree.Sub(s.now) >= 24*time.Hour { // the time of day alone would be ambiguous
				next = s.NextFree.Format("2006-01-02 15:04:05.000")
			}
		}
		for i, k := range s.Keys {
			ttl := k.TTL.String()
			switch {
			case !k.Exists:
				ttl = "(idle)"
			case k.TTL < 0:
				ttl = "none"
			}
			switch {
			case k.Protocol1:
				ttl += " (protocol 1 key: not read)"
			case k.NotRead:
				ttl += " (no such -limit: not read)"
			}
			if i == 0 {
				fmt.Fprintf(tw, "%q\t%v\t%s\t%s\t%s\t%s\t%s\n", s.Subject, s.Backlog, wait, next, avail, k.Key, ttl)
			} else {
				fmt.Fprintf(tw, "\t\t\t\t\t%s\t%s\n", k.Key, ttl)
			}
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, s := range f.Top {
		if s.err != nil {
			fmt.Fprintf(out, "%q unreadable: %v\n", s.Subject, s.err)
		}
	}
	return nil
}

// failed is a watch frame whose reading failed, as JSON.
type failed struct {
	Name       string    `json:"name"`
	NameBase64 string    `json:"name_base64,omitempty"`
	At         time.Time `json:"at"`
	Error      string    `json:"error"`
}

// printFailed prints a frame whose reading failed with err.
func (v *viewer) printFailed(out io.Writer, err error) error {
	f := failed{Name: v.name, NameBase64: exact(v.name), At: time.Now(), Error: err.Error()}
	if v.c.asJSON {
		return json.NewEncoder(out).Encode(f)
	}
	_, perr := fmt.Fprintf(out, "%s: reading failed (%s): %v\n", v.name, f.At.Format(time.RFC3339), err)
	return perr
}

// watch prints a reading every interval until ctx ends or count readings
// are printed. On a terminal each reading replaces the last. A reading
// that fails (Redis away or slow for a while) is printed as its error,
// and the next one is made at the next interval: a dashboard outlives a
// blip. It returns nil, or, when count ends it, the last reading's error.
func (v *viewer) watch(ctx context.Context, out io.Writer) error {
	clear := false
	if f, ok := out.(*os.File); ok && !v.c.asJSON {
		if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
			clear = true
		}
	}
	tick := time.NewTicker(v.c.interval)
	defer tick.Stop()
	for n := 1; ; n++ {
		subjects, err := v.read(ctx, nil)
		if err != nil && ctx.Err() != nil {
			return nil
		}
		if clear {
			fmt.Fprint(out, "\x1b[H\x1b[2J")
		}
		var perr error
		if err != nil {
			perr = v.printFailed(out, err)
		} else {
			perr = v.print(out, subjects)
		}
		if perr != nil { // out is gone
			return perr
		}
		if v.c.count > 0 && n >= v.c.count {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// reset clears subject s in every limit whose key exists.
func (v *viewer) reset(ctx context.Context, out io.Writer, s string) error {
	keys := []string{firstKey(v.name, s)} // s was checked by run
	found, err := v.db.scan(ctx, subjectPattern(v.c.prefix, v.name, s))
	if err != nil {
		return err
	}
	var old []string // of protocol version 1's layout: deleted too, in calls of their own
	for _, full := range found {
		if got, period, v1, ok := parseKey(full, v.c.prefix, v.name); ok && got == s && period != 0 {
			if v1 {
				old = append(old, strings.TrimPrefix(full, v.c.prefix))
			} else {
				keys = append(keys, strings.TrimPrefix(full, v.c.prefix))
			}
		}
	}
	for batch := range slices.Chunk(slices.Concat(keys, old), throttle.MaxLimits) {
		cctx, cancel := v.db.call(ctx)
		err = v.eng.Reset(cctx, batch...)
		cancel()
		if err != nil {
			return err
		}
	}
	keys = append(keys, old...)
	if v.c.asJSON {
		res := map[string]any{"name": v.name, "subject": s, "reset": keys}
		if b64 := exact(v.name); b64 != "" {
			res["name_base64"] = b64
		}
		if b64 := exact(s); b64 != "" {
			res["subject_base64"] = b64
		}
		if slices.ContainsFunc(keys, func(k string) bool { return !utf8.ValidString(k) }) {
			all := make([]string, len(keys))
			for i, k := range keys {
				all[i] = base64.StdEncoding.EncodeToString([]byte(k))
			}
			res["reset_base64"] = all
		}
		return json.NewEncoder(out).Encode(res)
	}
	fmt.Fprintf(out, "%s %q: reset (%s)\n", v.name, s, strings.Join(keys, ", "))
	return nil
}

// limitFlags are the -limit flags: RATE/PERIOD[:BURST], the first limit
// first (its key has no period suffix), then the others, matched to keys
// by period.
type limitFlags []throttle.Limit

func (l *limitFlags) String() string { return fmt.Sprint([]throttle.Limit(*l)) }

func (l *limitFlags) Set(s string) error {
	spec, burstStr, hasBurst := strings.Cut(s, ":")
	rateStr, periodStr, ok := strings.Cut(spec, "/")
	if !ok {
		return fmt.Errorf("limit %q: want RATE/PERIOD[:BURST], 10/1s:5", s)
	}
	rate, err := strconv.Atoi(rateStr)
	if err != nil {
		return fmt.Errorf("limit %q: rate: %w", s, err)
	}
	if !strings.ContainsAny(periodStr, "0123456789") {
		periodStr = "1" + periodStr // "10/s"
	}
	period, err := time.ParseDuration(periodStr)
	if err != nil {
		return fmt.Errorf("limit %q: period: %w", s, err)
	}
	burst := 0
	if hasBurst {
		if burst, err = strconv.Atoi(burstStr); err != nil {
			return fmt.Errorf("limit %q: burst: %w", s, err)
		}
	}
	lim := throttle.Every(period, rate, burst)
	if err := lim.Validate(); err != nil {
		return fmt.Errorf("limit %q: %w", s, err)
	}
	*l = append(*l, lim)
	return nil
}

// match returns the limits of a subject's keys, by period (0: the first
// limit), or nil if any of them is not known.
func (l limitFlags) match(periods []time.Duration) []throttle.Limit {
	if len(l) == 0 {
		return nil
	}
	out := make([]throttle.Limit, len(periods))
	for i, p := range periods {
		if p == 0 {
			out[i] = l[0]
			continue
		}
		k := slices.IndexFunc(l[1:], func(lim throttle.Limit) bool { return lim.Period == p })
		if k < 0 {
			return nil
		}
		out[i] = l[1+k]
	}
	return out
}
