package main

import (
	"fmt"
	"os"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/slotbook/slotbook/internal/contention"
)

// writePlot draws one timeline per mode, side by side: a row per client and
// a mark at each request's start.
func writePlot(path string, results []contention.Result) error {
	if filepath.Ext(path) != ".png" {
		return fmt.Errorf("-plot %q: want a .png file", path)
	}
	row := make([]*plot.Plot, len(results))
	var xmax float64
	for _, r := range results {
		for _, s := range r.Starts {
			xmax = max(xmax, s.Seconds())
		}
	}
	for i, r := range results {
		p := plot.New()
		p.Title.Text = fmt.Sprintf("%s: %d through, %.2f calls/request", r.Mode, r.Through, r.CallsPerRequest)
		p.X.Label.Text = "seconds"
		p.Y.Label.Text = "client"
		p.X.Min, p.X.Max = 0, xmax*1.02
		p.Y.Min, p.Y.Max = -1, float64(r.Clients)
		p.Add(plotter.NewGrid())
		var pts plotter.XYs
		for c, starts := range r.ByClient {
			for _, s := range starts {
				pts = append(pts, plotter.XY{X: s.Seconds(), Y: float64(c)})
			}
		}
		if len(pts) > 0 {
			sc, err := plotter.NewScatter(pts)
			if err != nil {
				return err
			}
			sc.GlyphStyle.Shape = draw.BoxGlyph{}
			sc.GlyphStyle.Radius = vg.Points(2)
			p.Add(sc)
		}
		row[i] = p
	}
	img := vgimg.New(vg.Points(float64(420*len(results))), vg.Points(360))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: len(results), PadX: vg.Millimeter * 4, PadTop: vg.Millimeter * 2,
		PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 4}
	canvases := plot.Align([][]*plot.Plot{row}, tiles, dc)
	for i, p := range row {
		p.Draw(canvases[0][i])
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
