"""Name pools of the fictional tool world (a data table, no logic).

Names are invented so that a policy cannot answer from pretraining knowledge:
every fact must come from a tool. Real ISO currency codes and real unit names
are kept because they are part of the skill being trained (conversions).
Countries keep fixed positions and UTC offsets across seeds so the world stays
geographically plausible; the seed moves cities around them, picks who founded
what, where landmarks stand, and every per-date value.
"""

from __future__ import annotations

# (country, currency, region, base latitude, base longitude, UTC offset in minutes,
#  its three cities as (name, airport code); the first city names the time zone).
# Offsets are fixed all year: the tool world has no daylight saving time.
COUNTRIES = (
    ("Aldoria", "EUR", "Europe", 47.5, 4.0, 60,
     (("Lunhaven", "LUN"), ("Port Ember", "PEM"), ("Castellane", "CSL"))),
    ("Veskland", "SEK", "Europe", 61.0, 16.0, 60,
     (("Frostvik", "FVK"), ("Hollmar", "HLM"), ("Eskerby", "ESK"))),
    ("Marenthia", "EUR", "Europe", 40.5, 15.0, 60,
     (("Bellarosa", "BLR"), ("Verano", "VRN"), ("San Caldo", "SCD"))),
    ("Norvale", "GBP", "Europe", 53.0, -3.0, 0,
     (("Ashford Bay", "ASB"), ("Kingsmere", "KGM"), ("Wrenwick", "WRW"))),
    ("Kestria", "CHF", "Europe", 46.8, 9.5, 60,
     (("Altberg", "ALB"), ("Zollhain", "ZLH"), ("Brunnsee", "BRS"))),
    ("Solvane", "USD", "America", 37.0, -100.0, -360,
     (("Redwater", "RDW"), ("Mesa Alta", "MSA"), ("Clearport", "CPT"))),
    ("Elbrenia", "CAD", "America", 49.0, -78.0, -300,
     (("Pinecrest", "PNC"), ("Lac-Dore", "LCD"), ("Northgate", "NGT"))),
    ("Tarvossa", "JPY", "Asia", 35.5, 137.0, 540,
     (("Harumi Bay", "HRB"), ("Kitazono", "KTZ"), ("Minatori", "MNT"))),
    ("Zephyria", "INR", "Asia", 20.0, 78.0, 330,
     (("Varanam", "VRM"), ("Kesarpur", "KSP"), ("Nilapuri", "NLP"))),
    ("Quorath", "AUD", "Oceania", -31.0, 141.0, 600,
     (("Coralmouth", "CRM"), ("Sundown", "SDN"), ("Emu Flats", "EMF"))),
)

# Units of each currency per US dollar, before the seed's +-5% jitter.
BASE_FX_PER_USD = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "CHF": 0.88, "SEK": 10.4,
                   "CAD": 1.36, "JPY": 151.0, "INR": 83.2, "AUD": 1.52}

# (company, ticker, sector)
COMPANIES = (
    ("Orrery Systems", "ORRY", "software"),
    ("Tidewater Foods", "TIDE", "food"),
    ("Quillstone Media", "QSTN", "media"),
    ("Meridian Aerospace", "MRDA", "aerospace"),
    ("Ferrowind Steel", "FRWD", "steel"),
    ("Lumina Pharma", "LUMP", "pharmaceuticals"),
    ("Halcyon Motors", "HLCN", "automotive"),
    ("Bluefin Logistics", "BFLG", "logistics"),
    ("Copperleaf Bank", "CPLB", "banking"),
    ("Starling Telecom", "STLG", "telecommunications"),
    ("Verdance Energy", "VRDE", "energy"),
    ("Nimbus Robotics", "NMBR", "robotics"),
)

# (landmark, kind, height range in metres)
LANDMARKS = (
    ("Ember Spire", "tower", (180, 420)),
    ("Glasswater Bridge", "bridge", (60, 190)),
    ("Cathedral of Saint Orla", "cathedral", (70, 150)),
    ("Harbour Light", "lighthouse", (25, 70)),
    ("Skyreach Tower", "tower", (200, 540)),
    ("Old Mill Dam", "dam", (40, 230)),
    ("Aurora Observatory", "observatory", (20, 60)),
    ("Crescent Arena", "stadium", (30, 75)),
    ("Iron Gate Bridge", "bridge", (50, 210)),
    ("Obelisk of Dawn", "monument", (30, 170)),
    ("Northwind Tower", "tower", (150, 380)),
    ("Temple of the Tides", "temple", (25, 90)),
)

FIRST_NAMES = ("Mara", "Tobias", "Ines", "Corwin", "Leota", "Anselm", "Brisa", "Dorian",
               "Elske", "Fenwick", "Galia", "Hadrian", "Isolde", "Jorah", "Kaija", "Lucan",
               "Mirela", "Nestor", "Odile", "Pascoe", "Quilla", "Rasmus", "Saoirse",
               "Thaddeus", "Ulla", "Vesna", "Wendel", "Xanthe", "Yorick", "Zelie")
LAST_NAMES = ("Quint", "Renwick", "Albrecht", "Voss", "Marlowe", "Castellan", "Drummond",
              "Ellery", "Fairweather", "Grell", "Holloway", "Ivarsen", "Jessop", "Kettering",
              "Lindqvist", "Moravec", "Northcote", "Okonkwo-Hale", "Pellegrin", "Quarles",
              "Rosenthal", "Sandoval", "Thorne", "Underhill", "Valcourt", "Whitlock",
              "Yarrow", "Zabini", "Ashdown", "Brightwater")

MASCOTS = ("Lions", "Rovers", "Comets", "Falcons", "Mariners", "Wolves", "Titans", "Pilots",
           "Storm", "Harriers", "Owls", "Stags")

# (league, sport, weekday of its rounds: Monday = 0)
LEAGUES = (("Continental Football League", "football", 5),
           ("Grand Basketball Association", "basketball", 2))

HOLIDAY_NAMES = ("Founders' Day", "Harvest Festival", "Lantern Night", "Unity Day",
                 "Spring Festival", "Remembrance Day", "Constitution Day", "Midsummer Day",
                 "Sea Day", "Labour Day", "Independence Day", "Festival of Lights")

AIRLINES = (("AR", "Aurora Air"), ("SK", "Skylark Airways"), ("MW", "Meridian Wings"),
            ("BX", "Bluejay Express"), ("TC", "Transcontinental"))

PRODUCTS = ("Atlas", "Helix", "Nova", "Pulse", "Vertex", "Zephyr", "Ion", "Solace")

FESTIVALS = ("jazz", "lantern", "harvest", "film", "kite", "winter light")
