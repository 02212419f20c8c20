package redistest

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// A Proxy is a loopback TCP proxy in front of a Redis, for fault tests: it
// adds latency to the bytes flowing through it without reordering them, and
// Close makes its address refuse connections (Redis unreachable).
//
// Delays hold bytes back; they never hold requests back from Redis unless
// asked: with SetReplyDelay a request reaches Redis at once, the script runs,
// and only its reply arrives late (a lost reply, if the client's timeout is
// shorter). A chunk of bytes is held for the delay in force when it arrived
// at the proxy, and never overtakes the bytes before it, so lowering a delay
// does not let later bytes jump ahead.
//
// Point a client at it with Client, or with a copy of the server's
// options:
//
//	opts := srv.Options()
//	opts.Addr = redistest.NewProxy(t, srv.Addr).Addr()
//
// A Proxy is safe for concurrent use. Build one with NewProxy; the zero
// Proxy is not usable.
type Proxy struct {
	target string
	ln     net.Listener
	ctx    context.Context // canceled by Close: stops dials in progress
	stop   context.CancelFunc
	wg     sync.WaitGroup // every goroutine the Proxy started

	mu      sync.Mutex // guards the fields below
	request time.Duration
	reply   time.Duration
	links   map[*link]struct{}
	closed  bool
}

// NewProxy starts a proxy on 127.0.0.1 (a free port) forwarding to target,
// a host:port. It is closed when the test ends.
func NewProxy(tb testing.TB, target string) *Proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("redistest: proxy: %v", err)
	}
	ctx, stop := context.WithCancel(context.Background())
	p := &Proxy{target: target, ln: ln, ctx: ctx, stop: stop, links: make(map[*link]struct{})}
	p.wg.Add(1)
	go p.accept()
	tb.Cleanup(p.Close)
	return p
}

// Addr returns the proxy's address, host:port on 127.0.0.1.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Client returns a client of srv through p, built from srv's options
// changed by each of tweak, and closed when the test ends.
func (p *Proxy) Client(tb testing.TB, srv *Server, tweak ...func(*redis.Options)) *redis.Client {
	tb.Helper()
	o := srv.Options()
	o.Addr = p.Addr()
	for _, f := range tweak {
		f(o)
	}
	c := redis.NewClient(o)
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// SetReplyDelay holds every byte from the server back for d before passing
// it to the client. Requests still reach the server at once.
func (p *Proxy) SetReplyDelay(d time.Duration) {
	p.mu.Lock()
	p.reply = d
	p.mu.Unlock()
}

// SetLatency holds bytes in both directions back for d each: a round trip
// then takes 2*d more.
func (p *Proxy) SetLatency(d time.Duration) {
	p.mu.Lock()
	p.request, p.reply = d, d
	p.mu.Unlock()
}

// Close stops the proxy: it stops listening (so that connecting to Addr is
// refused), drops every connection, and waits for its goroutines to end.
// Close is idempotent; NewProxy registers it with tb.Cleanup.
func (p *Proxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	p.stop()
	_ = p.ln.Close()
	for _, l := range links {
		l.close()
	}
	p.wg.Wait()
}

// Sever drops every connection open now, with whatever bytes they hold
// back (a reply in flight is lost), and goes on accepting new ones.
func (p *Proxy) Sever() {
	p.mu.Lock()
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	for _, l := range links {
		l.close()
	}
}

func (p *Proxy) delays() (request, reply time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.request, p.reply
}

// accept runs until the listener is closed.
func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

// serve connects client c to the target and starts the two pumps.
func (p *Proxy) serve(c net.Conn) {
	defer p.wg.Done()
	var d net.Dialer
	ctx, cancel := context.WithTimeout(p.ctx, 5*time.Second)
	s, err := d.DialContext(ctx, "tcp", p.target)
	cancel()
	if err != nil {
		_ = c.Close()
		return
	}
	l := &link{client: c, server: s, done: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		l.close()
		return
	}
	p.links[l] = struct{}{}
	p.mu.Unlock()
	p.pump(l, s, c, func() time.Duration { req, _ := p.delays(); return req })
	p.pump(l, c, s, func() time.Duration { _, rep := p.delays(); return rep })
	p.wg.Add(1)
	go func() { // forget l once it is closed
		defer p.wg.Done()
		<-l.done
		p.mu.Lock()
		delete(p.links, l)
		p.mu.Unlock()
	}()
}

// A link is one client connection and its connection to the server.
type link struct {
	client, server net.Conn
	once           sync.Once
	done           chan struct{} // closed by close
}

// close closes both connections, which ends both pumps.
func (l *link) close() {
	l.once.Do(func() {
		_ = l.client.Close()
		_ = l.server.Close()
		close(l.done)
	})
}

// chunk is bytes read from one side, due for the other at due.
type chunk struct {
	data []byte
	due  time.Time
}

// pump copies src to dst, holding each chunk back for the delay in force
// when it was read, in order. A reader goroutine stamps chunks, a writer
// goroutine sends them when due; when src ends the writer delivers what it
// holds and then closes the link.
func (p *Proxy) pump(l *link, dst, src net.Conn, delay func() time.Duration) {
	ch := make(chan chunk, 64)
	p.wg.Add(2)
	go func() {
		defer p.wg.Done()
		defer close(ch)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				select {
				case ch <- chunk{data: buf[:n], due: time.Now().Add(delay())}:
				case <-l.done:
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	go func() {
		defer p.wg.Done()
		defer l.close()
		for c := range ch {
			if wait := time.Until(c.due); wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-t.C:
				case <-l.done:
					t.Stop()
					return
				}
			}
			if _, err := dst.Write(c.data); err != nil {
				return
			}
		}
	}()
}
